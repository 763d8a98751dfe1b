"""Memory of one train step per device, predicted without devices or a compile.

    total = params + optimizer + batch           (the step's arguments: what stays resident between steps)
          + gradients + activations + workspace  (what lives during the step)

State — exact, the sums of shard sizes. Every parameter's PartitionSpec comes from its logical axes through the
plan's rules (`jaxpar.plan.plan_rules`, no mesh needed) and ZeRO's data split (`sharding.zero_spec`):
    params      Σ ⌈shape / mesh degrees of its spec⌉ · param bytes   (ZeRO-3 adds `data` to each)
    optimizer   AdamW's two moments, each as its parameter but split over `data` from ZeRO-1, + the step counters
    gradients   one float per parameter as the step holds it, whole over `data` until the step's end (gradient
                accumulation adds a second: the sum); ZeRO-3 adds the parameters it gathers whole for the step
    batch       the int32 token rows [B / (data·pipe·expert), T + 1]

Activations — traced, not hand-written. `jax.vjp` of the model itself (abstract arrays, no memory), with one tensor
rank's shapes (heads/t, kv heads max(K/t, 1), d_ff/t, vocab/t), one row of the device's tokens and the remat policy,
two layers one scan trip each, lists what autodiff keeps for the backward (`residuals`). A compiled program holds
them in one of two ways, and both are read off the trace:
    unrolled  the layers one scan trip (scan_unroll ≥ the layers): XLA holds one buffer per value — each residual
              followed back through reshapes and broadcasts to what it views, those of arguments or of no argument
              (masks, rope tables: fused into their readers) dropped
    a loop    a scan of several trips (sequence parallel runs one layer a trip), a pipeline: every residual JAX lists
              is a stacked [n, …] output of its own, views included, and the loop-invariant constants are held once
So the formula follows the code — a new policy, a named checkpoint or an MoE router changes the trace, not this
file. Each residual is classified by the `checkpoint_name` it carries, is computed from or is passed on to
(`Entry.tag`: the residual stream, the MLP's hidden, q/k/v, the experts' rows), not by its width. Then, per device
(b rows, A = grad_accum: one chunk's activations at a time):
    no pipeline       L layers on b/A rows
    circular          autodiff of the loop stacks every iteration's: (v·m + p − 1) chunks of k layers on a
                      microbatch, and the k layers' weights each iteration read (its pass is a traced index); the
                      carries io [q, mb, …], shift, park, and their cotangents
    a schedule table  the executor's buffers (`schedule.Program`, one scratch slot each), a slot's contents read off
                      the executor's own chunk trace (`table_chunk`, `executor.Chunk`): (n_stash + 1) stash slots,
                      (n_tape + 1) tape (the matmul groups' inputs), (n_dys + 1) dys (their output gradients),
                      (n_inbox + 1) messages [mb, s, h]; the tick's switch returns one of each and the chunk's and
                      `rest`'s gradients (every branch returns them all); for v > 1 the tick's chunk parameters
                      (a dynamic slice of the stage's [v, …])
    sequence parallel the residual stream's tensors (STREAM) split over `tensor` (Korthikanti et al. 2022); under
                      `dots` the saved matmul outputs stay whole-sequence (the row-parallel partial sums before the
                      reduce-scatter), and the plain SP entry's column outputs are not saved (a nested custom VJP
                      hides them from the policy; collective matmul's are); a table's tape and dys split where the
                      groups see the stream (the column inputs, the row outputs)
    context parallel  s/c query tokens a rank; all_gather's gathered K/V and [s/c, s] scores are c times the local
                      trace's (the ring keeps its own blocks only, but each ring step's linearized `cond` leaves
                      mask-shaped buffers XLA hoists out of the loops: `_ring_hoisted`)
    hoisted masks     the causal mask broadcast to the scores, loop-invariant: held once by a loop (and under remat,
                      where the recomputation reads it, hoisted out of the loops)
    schedule tables   head and loss one microbatch at a time
Workspace — what the backward holds on top of the saved (XLA's temporaries): one layer's activations as an unrolled
program holds them without remat, where the backward brings a layer back at a time — under remat (`dots`: only the
attention scores and probabilities; XLA fuses the rest of the recompute into the backward's kernels) and in a loop's
trip — times `WORKSPACE`, measured. A schedule table's running branch holds one layer's activations whatever the
remat (W replays a period, B recomputes what the stash lacks: `_table_branch`).

Backends — what a compiler holds that the trace does not show is one `Corrections` per backend (`CORRECTIONS`,
measured for XLA:CPU: float32 activations, the dense MoE expert buffers, temporaries stacked along the calls;
neutral where unmeasured). bench/RESULTS.md has the measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax._src import core as jax_core  # Var, Literal: the jaxpr the residuals are read from

from jaxpar.config import Config, ModelConfig
from jaxpar.families import attention_kind
from jaxpar.model import (abstract_model, attention_mask, default_positions, layer_groups, run_layers, trainable)
from jaxpar.parallel import executor, pipeline
from jaxpar.parallel.axes import AXES, BATCH_AXES, DATA, TENSOR
from jaxpar.plan import padded_vocab, plan_rules
from jaxpar.parallel.context import SINGLE_DEVICE
from jaxpar.parallel.weightgrad import MEASURE
from jaxpar.planner import expected
from jaxpar.sharding import logical_to_spec, zero_spec

# XLA's temporaries beyond the saved activations and gradients, in units of the backward's working set (one layer's
# activations, recomputed under remat or a loop trip's; where larger, the dense MoE expert buffers of `Corrections`):
# the least-squares fit over bench/plan.py's layouts that have one (bench/RESULTS.md).
WORKSPACE = 1.0


@dataclasses.dataclass(frozen=True)
class Corrections:
    """What one backend's compiled step holds that the traced model misses, one named correction each, from that
    backend's own buffer assignments; the defaults correct nothing (a backend not measured: `CORRECTIONS`).
    bench/RESULTS.md ("Planner memory: the XLA:CPU corrections") has the measurements."""

    # no 16-bit float arithmetic: bf16/f16 activations computed and kept in float32 (llama_8b on 64 devices)
    float32_activations: bool = False
    # `ragged_dot` lowered densely: the experts' model-width rows (EXPERT_ROWS) kept X/ep times (moe_tiny's step)
    dense_experts: bool = False
    # float32 [X/ep, M, F/t] a dense experts' backward holds at once: gate, up, product, gradients (moe_tiny, mixtral)
    expert_hidden_buffers: float = 0.0
    # float32 [X/ep, M, h] of the down projection's weight gradient (moe_tiny, mixtral_8x7b, qwen2_moe_57b)
    expert_model_buffers: float = 0.0
    # temp allocation stacks each computation's peak on its callers' (`analysis.heap`; llama_8b's, mixtral's tables)
    stacked_temporaries: bool = False


# Per backend (`jax.Device.platform`); the neutral `Corrections()` where nothing was measured.
CORRECTIONS = {
    "cpu": Corrections(float32_activations=True, dense_experts=True, expert_hidden_buffers=7.0,
                       expert_model_buffers=3.5, stacked_temporaries=True),
    "gpu": Corrections(),
    "tpu": Corrections(),
}


def corrections(backend: str) -> Corrections:
    """The backend's `Corrections` (a platform not in `CORRECTIONS` gets none)."""
    return CORRECTIONS.get(backend, Corrections())


@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device of one train step, by part (see the module docstring)."""

    params: int
    optimizer: int
    batch: int
    gradients: int
    activations: float
    workspace: float

    @property
    def resident(self) -> int:
        """What the step's arguments hold: the training state and the batch (compare `argument_size_in_bytes`)."""
        return self.params + self.optimizer + self.batch

    @property
    def total(self) -> float:
        return self.resident + self.gradients + self.activations + self.workspace

    def as_dict(self) -> dict[str, float]:
        """Bytes by part, with `resident` and `total`, for JSON."""
        return {**dataclasses.asdict(self), "resident": self.resident, "total": self.total}


def degrees_of(config: Config) -> dict[str, int]:
    """{mesh axis: degree} of a config resolved for its devices (data filled in)."""
    return dict(zip(AXES, config.mesh_shape))


def _shard_bytes(v: nnx.Variable, rules, degrees: dict[str, int], zero_data: int) -> int:
    axes = tuple(v.get_metadata().get("logical_axes") or (None,) * len(v.shape))
    spec = zero_spec(logical_to_spec(axes, rules), v.shape, zero_data)
    n = 1
    for size, entry in zip(v.shape, tuple(spec) + (None,) * (len(v.shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-size // math.prod(degrees[a] for a in names))
    return n * jnp.dtype(v.dtype).itemsize


def param_bytes(config: Config, zero_data: int = 1, weights_only: bool = False) -> int:
    """Bytes of one device's shards of the model state — every parameter and buffer (`model.Buffer`; the weights
    alone with `weights_only`: what Adam keeps moments of) — each array also split over `data` when zero_data > 1
    (ZeRO) and its dims allow (`sharding.zero_spec`)."""
    return _param_shards(config.model, tuple(degrees_of(config).items()), zero_data, weights_only)


def state_floor(config: Config, devices: int) -> float:
    """A lower bound of every layout's predicted memory per device on `devices`: the model's parameters and Adam's
    two moments, each byte held by some device, spread evenly (no layout built, nothing traced: what lets the search
    give up at once on a budget no layout can meet)."""
    whole = _param_shards(config.model, tuple((a, 1) for a in AXES), 1)
    return 3 * whole / devices


def state_bytes(config: Config) -> dict[str, int]:
    """params, optimizer, gradients and batch bytes per device: exact sums over the shards (see the docstring)."""
    p, degrees = config.parallel, degrees_of(config)
    param = param_bytes(config, p.data if p.zero >= 3 else 1)
    moments = param_bytes(config, p.data if p.zero >= 1 else 1, weights_only=True)  # no moments of a buffer
    rows = config.train.batch_size // math.prod(degrees[a] for a in BATCH_AXES)
    # The step's gradients are whole over `data` until its end (ZeRO-3's reduce-scatter comes after the last
    # chunk: `train.step._mean`), and ZeRO-3 gathers every parameter whole for the step (`gather_zero`): one more
    # copy, held throughout.
    whole = param_bytes(config) if p.zero >= 3 else param
    return {"params": param, "optimizer": 2 * moments + _adam_counters() + 4,  # + the state's int32 step
            "gradients": whole * (2 if config.train.grad_accum > 1 else 1) + (whole if p.zero >= 3 else 0),
            "batch": rows * (config.train.seq_len + 1) * 4}


@functools.lru_cache(maxsize=64)
def _variables(model: ModelConfig, vocab: int, weights_only: bool = False) -> tuple[nnx.Variable, ...]:
    _, params = abstract_model(model, vocab)
    params = trainable(params) if weights_only else params
    return tuple(jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


@functools.lru_cache(maxsize=4096)
def _param_shards(model: ModelConfig, degrees: tuple, zero_data: int, weights_only: bool = False) -> int:
    """Bytes of one device's shards of the model state (of its weights alone with `weights_only`)."""
    degrees = dict(degrees)
    rules = plan_rules(model, degrees)
    return sum(_shard_bytes(v, rules, degrees, zero_data)
               for v in _variables(model, padded_vocab(model, degrees[TENSOR]), weights_only))


def kv_cache_bytes(model: ModelConfig, batch: int, slots: int, data: int = 1, tensor: int = 1) -> int:
    """Bytes one device holds of the inference cache (`jaxpar.infer.decode`: the attention kind's arrays
    [L, B, slots, *slot] in the model's dtype, rows over `data`, each tensor rank's share as its kind declares it,
    `AttentionKind.cache`):

        L · ⌈B / data⌉ · slots · Σ_arrays |slot| · itemsize
        (GQA: keys and values, |slot| = K_local · E, K_local = K / t, or 1 when K does not split over t)

    Every layer's cache is on every device (inference runs no pipeline). A generate call's `slots` is the padded
    prompt length plus max_new_tokens."""
    per_slot = sum(math.prod(a.shape) for a in attention_kind(model).cache(model, tensor).values())
    return model.n_layers * -(-batch // data) * slots * per_slot * jnp.dtype(model.dtype).itemsize


def inference_bytes(model: ModelConfig, batch: int, slots: int, data: int = 1, tensor: int = 1) -> dict[str, int]:
    """Memory per device of serving `batch` rows of `slots` cache slots on a (data, tensor) mesh: the parameter shards
    (exact, as `param_bytes`: the vocab padded for `tensor`) and the KV cache (`kv_cache_bytes`) — what a decode
    step's arguments hold; its temporaries are one token's activations, small beside them."""
    degrees = tuple({**{a: 1 for a in AXES}, DATA: data, TENSOR: tensor}.items())
    params = _param_shards(model, degrees, 1)
    cache = kv_cache_bytes(model, batch, slots, data, tensor)
    return {"params": params, "kv_cache": cache, "total": params + cache}


@functools.cache
def _adam_counters() -> int:
    """Bytes of AdamW's state besides its moments (its step counts), from optax itself: its state for no parameters."""
    empty = jax.eval_shape(optax.adamw(optax.constant_schedule(1.0)).init, {})
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(empty))


def local_model(model: ModelConfig, degrees: dict[str, int]) -> ModelConfig:
    """The model as one tensor rank holds it: its attention kind's share (`AttentionKind.local`: GQA's a/t query
    heads and K/t or one kv heads), d_ff/t (and the experts'), vocab/t — what a device computes, as a plain model the
    residual trace can run."""
    t = degrees[TENSOR]
    moe = model.moe
    if moe.enabled:
        moe = dataclasses.replace(moe, d_ff=moe.d_ff // t, shared_d_ff=moe.shared_d_ff // t)
    return dataclasses.replace(model, **attention_kind(model).local(model, t),
                               head_dim=model.head_dim, d_ff=model.d_ff // t, vocab_size=padded_vocab(model, t) // t,
                               moe=moe, weights="float", attention="xla")


# Ops whose result XLA does not hold apart from their operand (a bitcast, or a broadcast fused into its readers).
_VIEWS = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy", "copy_p"})


# The named activations (`model.CHECKPOINT_NAMES`) by what they are: the residual stream [.., h] (LAYER_IN: the
# layer's input, the layers' scan carry, which no block names) and the MLP's hidden [.., F].
LAYER_IN = "layer_in"
STREAM = frozenset({LAYER_IN, "attn_in", "attn_out", "mlp_in", "mlp_out"})
HIDDEN = frozenset({"mlp_gate", "mlp_up", "mlp_hidden"})
EXPERT_ROWS = frozenset({"expert_in", "expert_out"})  # an MoE layer's [M, h] rows (`model.grouped_swiglu`)

# Ops that pass their operand's elements on unchanged, up to layout and dtype (a residual computed so carries its
# operand's tag, and an operand its result's), and elementwise ops, which do for an operand of the result's shape.
_PASSES = (_VIEWS - {"broadcast_in_dim"}) | {"convert_element_type", "reduce_precision", "slice", "split",
                                              "concatenate", "transpose"}
_ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "expm1",
                          "logistic", "tanh", "rsqrt", "sqrt", "integer_pow", "pow", "square", "max", "min", "select_n",
                          "sin", "cos", "abs", "sign", "erf", "erf_inv", "stop_gradient"})


def _passes(e, x, y) -> bool:
    if e.primitive.name == "gather":  # rows picked from its first operand (the experts' sort and unsort)
        return x is e.invars[0]
    return e.primitive.name in _PASSES or (e.primitive.name in _ELEMENTWISE and x.aval.shape == y.aval.shape)


def _calls(e) -> bool:
    return e.primitive.name == "scan" or "jaxpr" in e.params or "call_jaxpr" in e.params


def _body(e):
    j = e.params.get("jaxpr") or e.params.get("call_jaxpr")
    return getattr(j, "jaxpr", j)


def _inner_seeds(e, tag: dict) -> tuple[dict, dict]:
    """({inner invar: tag}, {inner outvar: tag}) of the jaxpr e calls, from the tags of e's operands and results
    (a scan's carry is the layer's input: LAYER_IN)."""
    body = _body(e)
    ins = {b: tag[x] for b, x in zip(body.invars, e.invars) if isinstance(x, jax_core.Var) and x in tag}
    if e.primitive.name == "scan":
        consts, carry = _scan_split(e)
        ins.update({b: LAYER_IN for b in body.invars[consts:consts + carry]})
    outs = {b: tag[y] for b, y in zip(body.outvars, e.outvars) if isinstance(b, jax_core.Var) and y in tag}
    return ins, outs


def _forward_tags(jaxpr, tag: dict) -> dict:
    """Tags of jaxpr's values from those of its inputs (`tag`, updated): a `checkpoint_name`'s name, or its operand's
    through the ops that pass it on (`_passes`), into and out of the jaxprs an equation calls."""
    for e in jaxpr.eqns:
        if e.primitive.name == "name":
            tag[e.outvars[0]] = e.params["name"]
        elif _calls(e):
            inner = _forward_tags(_body(e), _inner_seeds(e, tag)[0])
            tag.update({y: inner[b] for b, y in zip(_body(e).outvars, e.outvars)
                        if isinstance(b, jax_core.Var) and b in inner})  # a body may return a constant (Literal)
        else:
            for y in e.outvars:
                x = next((x for x in e.invars if isinstance(x, jax_core.Var) and x in tag and _passes(e, x, y)), None)
                if x is not None:
                    tag[y] = tag[x]
    return tag


def _backward_tags(jaxpr, tag: dict) -> dict:
    """What `tag` (updated) leaves untagged takes the tag of what it is passed on to (a matmul's output named after
    a rope or a cast, its operands through the ops that pass it: `_passes`)."""
    for e in reversed(jaxpr.eqns):
        y = next((y for y in e.outvars if y in tag), None)
        if y is None or _calls(e):
            continue
        for x in e.invars:
            if isinstance(x, jax_core.Var) and x not in tag and (e.primitive.name == "name" or _passes(e, x, y)):
                tag[x] = tag[y]
    return tag


class _Scope:
    """One jaxpr of the traced step, with which of its values depend on the step's arguments (`depends`), each
    value's tag (`tags`: the `checkpoint_name` it carries, is computed from, or is passed on to — `_forward_tags`,
    `_backward_tags`) and, for a nested one, where its inputs come from outside (`outer`: inner var → (outer var,
    outer scope); the scan's carry has none: it is the layer's input)."""

    def __init__(self, jaxpr, depends: list[bool], outer: dict | None = None, in_layer: bool = False,
                 seeds: tuple[dict, dict] = ({}, {})):
        self.jaxpr, self.outer, self.in_layer = jaxpr, outer, in_layer
        self.producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.depends = {v for v, d in zip(jaxpr.invars, depends) if d}
        for e in jaxpr.eqns:
            if any(isinstance(x, jax_core.Var) and x in self.depends for x in e.invars):
                self.depends.update(e.outvars)
        ins, outs = seeds
        self.tags = _forward_tags(jaxpr, dict(ins))
        self.tags.update({v: t for v, t in outs.items() if v not in self.tags})
        _backward_tags(jaxpr, self.tags)
        self._inner: dict[int, _Scope] = {}

    def inner(self, e) -> "_Scope":
        """The scope of the jaxpr an equation calls (a scan's body, a jit's or a checkpoint's function)."""
        if id(e) not in self._inner:
            self._inner[id(e)] = self._call(e)
        return self._inner[id(e)]

    def _call(self, e) -> "_Scope":
        seeds = _inner_seeds(e, self.tags)
        if e.primitive.name == "scan":
            body = e.params["jaxpr"].jaxpr
            consts, carry = _scan_split(e)
            dep = [isinstance(x, jax_core.Var) and x in self.depends or consts <= j < consts + carry
                   for j, x in enumerate(e.invars)]
            outer = {b: (o, self) for j, (b, o) in enumerate(zip(body.invars, e.invars))
                     if not consts <= j < consts + carry}
            return _Scope(body, dep, outer, in_layer=True, seeds=seeds)
        j = _body(e)
        return _Scope(j, [isinstance(x, jax_core.Var) and x in self.depends for x in e.invars],
                      dict(zip(j.invars, [(x, self) for x in e.invars])), self.in_layer, seeds)


def _scan_split(e) -> tuple[int, int]:
    """(consts, carry) input counts of a scan equation."""
    if "num_consts" in e.params:
        return e.params["num_consts"], e.params["num_carry"]
    consts, carry, _ = e.params["ft_in"].update(list(range(len(e.invars)))).unpack()
    return len(list(consts)), len(list(carry))


def _buffer(v, scope: _Scope):
    """(the value, its scope) whose buffer holds residual v — followed back through views, out of calls and into a
    scan's body — or None where it holds no activation: an argument (resident), a value that depends on no argument
    (a mask, a rope table: constants XLA fuses into their readers) or a view of one."""
    while True:
        if isinstance(v, jax_core.Literal):
            return None
        e = scope.producer.get(v)
        if e is None:  # an input of this jaxpr
            if scope.outer is None:
                return None  # an argument of the step
            if v not in scope.outer:  # the scan's carry: the layer's input
                return v, scope
            v, scope = scope.outer[v]
        elif e.primitive.name in _VIEWS:
            v = e.invars[0]
        elif e.primitive.name == "scan" and e.outvars.index(v) < _scan_split(e)[1]:
            return v, scope  # the scan's final carry (the last layer's output): its own buffer, held once
        elif e.primitive.name == "scan" or "jaxpr" in e.params or "call_jaxpr" in e.params:
            inner = scope.inner(e)
            v, scope = inner.jaxpr.outvars[e.outvars.index(v)], inner
        else:
            return (v, scope) if v in scope.depends else None


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What autodiff of the plain model keeps for the backward, for one sequence and one layer kind, as `Entry`s
    (`residuals`):
        layer     one layer's buffers as an unrolled program holds them (views of one value one buffer)
        stacked   one layer's residuals as a loop over layers stacks them: one [n, …] output per residual JAX
                  lists, views included (each is written by its own dynamic-update-slice)
        outside   the embedding, head and loss's buffers
        constant  what depends on no argument (the causal mask as the where's tangent, rope tables): fused into
                  its readers in an unrolled program, but a loop reads it as an input, held once"""

    layer: tuple
    stacked: tuple
    outside: tuple
    constant: tuple


class Entry(NamedTuple):
    """One buffer the step holds for the backward: its shape (without a stack's leading [n]), bytes, whether it is a
    matmul's output (`_is_dot`), and its tag — the `checkpoint_name` it carries, is computed from or is passed on to
    (`_Scope.tags`; LAYER_IN the layer's input), None where it has none (the attention scores, a norm's statistics,
    the logits, the routing)."""

    shape: tuple[int, ...]
    nbytes: int
    dot: bool
    tag: str | None


def _entry(aval, dot: bool, tag: str | None, stacked: bool = False) -> Entry:
    shape = tuple(aval.shape)[1 if stacked else 0:]
    return Entry(shape, aval.size * aval.dtype.itemsize // (aval.shape[0] if stacked and aval.shape else 1), dot, tag)


def _tag(v, scope: _Scope, held) -> str | None:
    """The tag of residual v of `scope`: its buffer's (`held`, from `_buffer`), or for none its own."""
    return held[1].tags.get(held[0]) if held is not None else scope.tags.get(v)


def _is_dot(v, scope: _Scope) -> bool:
    """Whether the buffer v holds is a matmul's output (`dot_general`, then perhaps rounded or cast to the compute
    dtype: the matmul policy's `reduce_precision` / `convert_element_type`)."""
    e = scope.producer.get(v)
    while e is not None and e.primitive.name in ("reduce_precision", "convert_element_type"):
        x = e.invars[0]
        e = scope.producer.get(x) if isinstance(x, jax_core.Var) else None
    return e is not None and e.primitive.name == "dot_general"


@functools.lru_cache(maxsize=256)
def residuals(model: ModelConfig, seq: int, remat: str, moe_layer: bool) -> Residuals:
    """What autodiff of the plain model keeps for the backward (`Residuals`), for one sequence of `seq` tokens and
    one layer kind (MoE or dense), traced with two layers, one a scan trip.

    The residuals are those of `jax.vjp` (what `jax.ad_checkpoint.print_saved_residuals` lists). As buffers of an
    unrolled program each is followed back through reshapes and broadcasts to the value it views (JAX saves a
    matmul's input once per matmul, reshaped, and the repeated GQA keys; XLA holds one buffer), and those of the
    step's arguments (resident) or of no argument at all (constants) are left out: what then lives in the scan's
    body is a layer's, the rest outside."""
    moe = model.moe
    # The dense kind is a fresh MoEConfig (n_experts 0): no MoE field shapes a dense layer, and the routing fields
    # (sigmoid scoring, groups, correction bias) are refused without experts.
    kind = dataclasses.replace(moe, sparse_step=1, dense_layers=()) if moe_layer else type(moe)()
    cfg = dataclasses.replace(model, n_layers=2, moe=kind, scan_unroll=1)  # one layer per scan trip
    graphdef, params = abstract_model(cfg)
    leaves, tree = jax.tree.flatten(params)

    def loss(p, batch):
        logits = nnx.merge(graphdef, p)(batch[:, :-1], remat=remat)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1).mean()

    def vjp(*args):
        return jax.vjp(lambda *a: loss(jax.tree.unflatten(tree, a[:-1]), a[-1]), *args)

    closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(*leaves, jax.ShapeDtypeStruct((1, seq + 1), jnp.int32))
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shapes[1]))  # the vjp closure's leaves: the residuals, last among the outputs
    top = _Scope(jaxpr, [True] * len(jaxpr.invars))
    seen, layer, stacked, outside, constant = set(), [], [], [], []
    for v in jaxpr.outvars[len(jaxpr.outvars) - n:]:
        if not isinstance(v, jax_core.Var) or v in jaxpr.invars:
            continue
        held = _buffer(v, top)
        dot, tag = held is not None and _is_dot(*held), _tag(v, top, held)
        e = top.producer.get(v)
        if e is not None and e.primitive.name == "scan" and e.outvars.index(v) >= _scan_split(e)[1]:
            body = top.inner(e)  # a [2, …] stack of the two layers', tagged as the body's value (a view's own)
            stacked.append(_entry(v.aval, dot, body.tags.get(body.jaxpr.outvars[e.outvars.index(v)]), stacked=True))
        elif v not in top.depends:
            constant.append(_entry(v.aval, False, tag))
        if held is None or held[0] in seen:
            continue
        seen.add(held[0])
        (layer if held[1].in_layer else outside).append(_entry(held[0].aval, dot, tag))
    return Residuals(tuple(layer), tuple(stacked), tuple(outside), tuple(constant))


@dataclasses.dataclass(frozen=True)
class TableChunk:
    """One slot of each of a schedule table executor's buffers, for one sequence of the chunk's k layers, as
    `Entry`s without the leading [k] (`table_chunk`): the stash (the chunk's vjp closure's
    activations), the tape (its matmul groups' inputs) and dys (their output gradients)."""

    stash: tuple
    tape: tuple
    dys: tuple


@functools.lru_cache(maxsize=256)
def table_chunk(model: ModelConfig, seq: int, remat: str, k: int) -> TableChunk:
    """What the table executor holds a slot for one chunk of k of the model's pipelined layers (its first k, or the
    first k after a dense prefix: `ModelConfig.prefix_layers`) and one sequence of `seq` tokens — read off the
    executor's own `executor.Chunk` (its MEASURE and RECORD traces), so a slot's contents follow the code: what
    autodiff of the tape-run chunk keeps (under `remat`), less the parameters, the zero probes and the constants
    the executor takes again in B. A tape or dys entry is tagged as the group input or output it holds in the
    MEASURE trace."""
    moe = model.moe
    if model.prefix_layers:  # the chunks hold the MoE layers after DeepSeek's dense prefix (which runs beside them)
        moe = dataclasses.replace(moe, dense_layers=(), sparse_step=1)
    cfg = dataclasses.replace(model, n_layers=k, moe=moe, mtp_depth=0)
    graphdef, params = abstract_model(cfg)
    leaves, tree = jax.tree.flatten(params)

    def trace(leaves, x):
        stacks = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)).stacks()
        positions, mask = default_positions(*x.shape[:2]), attention_mask(seq, None)

        def chunk_fn(chunk, x, tape, consts):  # (no constants: the trace's stacks hold the buffers it reads)
            if tape.mode == MEASURE:
                measured.append(tape)
            return run_layers(chunk, x, positions, mask, cfg, remat=remat, par=SINGLE_DEVICE.with_tape(tape),
                              stats=True)

        measured = []
        chunk = executor.Chunk(chunk_fn, stacks, jax.tree.map(lambda a: a * 1, stacks), x, lambda w, role: w)
        # the slots, then the MEASURE trace's group inputs and outputs, which the tape and dys slots are shaped as
        return (chunk.stash_ref, chunk.tape_ref, chunk.dys_ref,
                jax.tree.leaves(measured[0].inputs), jax.tree.leaves(measured[0].outputs))

    x = jax.ShapeDtypeStruct((1, seq, model.d_model), jnp.float32)  # the residual stream
    closed, (stash, tape, dys, _, _) = jax.make_jaxpr(trace, return_shape=True)(leaves, x)
    top = _Scope(closed.jaxpr, [True] * len(closed.jaxpr.invars))
    n_stash, n_tape, n_dys = len(stash), len(tape), len(dys)
    slots, groups = closed.jaxpr.outvars[:n_stash + n_tape + n_dys], closed.jaxpr.outvars[n_stash + n_tape + n_dys:]
    tags = [None] * n_stash + [_tag(v, top, _buffer(v, top)) if isinstance(v, jax_core.Var) else None
                               for v in groups]
    entries = []
    for v, tag in zip(slots, tags, strict=True):
        held = _buffer(v, top) if isinstance(v, jax_core.Var) else None
        entries.append(_entry(v.aval, held is not None and _is_dot(*held), tag or _tag(v, top, held), stacked=True))
    return TableChunk(tuple(entries[:n_stash]), tuple(entries[n_stash:n_stash + n_tape]),
                      tuple(entries[n_stash + n_tape:]))


def _scaled(entries, config: Config, s_local: int, routed: tuple[float, float] = (1.0, 1.0)) -> float:
    """Bytes of residual entries once sequence and context parallelism act on them (see the docstring), each by its
    tag (`Entry.tag`); `routed` multiplies the experts' rows (2-D residuals of s·k routed assignments a sequence;
    `_routed_factor`: [the rest, the experts' model-width rows (EXPERT_ROWS)])."""
    m, p = config.model, config.parallel
    t, c = p.tensor, p.context
    total = 0.0
    for shape, nbytes, dot, tag in entries:
        size = math.prod(shape)
        if len(shape) == 2 and shape[0] == s_local * m.moe.top_k:  # an expert-side [rows·k, n] (MoE layers only)
            nbytes *= routed[tag in EXPERT_ROWS]
        if p.sequence_parallel and t > 1 and dot and p.remat == "dots" and shape[0] == s_local:
            # Under `dots` the policy saves matmul outputs over the whole sequence, the row-parallel ones [s, h]
            # included: their partial sums before the reduce-scatter (`TensorParallel.row`; collective matmul's t
            # chunk partials [s/t, h], the same bytes) — the saved value the backward rebuilds the residual stream
            # from. The column-parallel outputs (q, k, v, gate, up) are saved only under collective matmul, whose
            # custom VJP computes its chunks' matmuls in its forward (`overlap.gather_matmuls`); the plain SP entry
            # (`sequence.gather_matmuls`) calls a custom VJP inside its own, which hides its matmuls from the
            # policy, and its backward recomputes them from the re-gathered shard.
            if tag not in STREAM and p.overlap != "collective_matmul":
                continue  # (a schedule table's chunk too: RECORD checkpoints each period under the policy)
        elif p.sequence_parallel and tag in STREAM and size % (s_local * m.d_model) == 0:
            nbytes /= t  # the residual stream between tensor regions: [rows, s/t, h]
        if c == 1 or p.context_impl == "ring":  # the ring keeps no [s/c, s] score row, only its own blocks
            pass
        elif len(shape) >= 4 and shape[-2:] == (s_local, s_local):  # [B, K, G, T, S] and the like
            nbytes *= c  # scores against the whole row's keys
        elif tag in ("k", "v") and len(shape) == 4 and shape[1] == s_local:
            nbytes *= c  # gathered keys or values [rows, s, K, E]
        total += nbytes
    return total


def _ring_hoisted(config: Config, rows: int, s: int) -> float:
    """Bytes ring attention's blocks leave held for the whole step: autodiff linearizes each of the c ring steps'
    `lax.cond` (`context_parallel._ring_forward`), whose residuals include the step's causal mask broadcast to the
    block's scores, [rows, K, G, T, T] as bool and as float32, beside a zero output [rows, T, K, G, E] and the
    running max and sum; they depend on the mask alone (the rank's positions, static), so XLA hoists them out of
    the layer and accumulation loops, one set per ring step, whatever the depth."""
    m, t, c = config.model, config.parallel.tensor, config.parallel.context
    heads = m.n_heads // t  # K·G: the rank's query heads
    scores = rows * heads * s * s * (4 + 1)  # float32 and bool [rows, K, G, T, T], T = s (the rank's tokens)
    return c * (scores + rows * heads * s * (m.head_dim + 2) * 4 + s * s * 4)


def _routed_factor(config: Config, fix: Corrections) -> tuple[float, float]:
    """How much larger an MoE layer's expert rows [rows·k, n] are than the trace's, (for the rest, for the experts'
    model-width rows EXPERT_ROWS): expert parallelism pads each rank's exchange to the worst case, ep·min(k, X/ep)
    rows a token instead of k (dropless); a dense `ragged_dot` (`fix.dense_experts`) keeps the model-width rows X/ep
    times. A GPU's grouped GEMM keeps the rows once."""
    moe, ep = config.moe, config.parallel.expert
    if not moe.enabled:
        return 1.0, 1.0
    local = moe.n_experts // ep
    pad = ep * min(moe.top_k, local) / moe.top_k if not moe.capacity_factor else 1.0
    return pad, pad * (local if fix.dense_experts else 1)


def _layers_loop(config: Config, n_layers: int, single: bool = False) -> bool:
    """Whether the scan over `n_layers` layers (a pipeline chunk's, or the model's) runs more than one trip:
    `scan_unroll` periods a trip, one under sequence parallelism (`jaxpar.plan.make_plan`); `single`: as
    one scan (a schedule table's chunk under its tape, `model.run_layers`)."""
    m, p = config.model, config.parallel
    unroll = 1 if p.sequence_parallel and p.tensor > 1 else m.scan_unroll
    groups = layer_groups(m.layer_pattern[:n_layers], single=single)
    return any(count > max(1, unroll // len(period)) for period, count in groups)


def _stage_weights(config: Config) -> int:
    """Bytes of one pipeline chunk's layer weights on a device (k layers, as every rank of `tensor`/`expert` holds
    them; ZeRO-3 gathers them whole for the step)."""
    degrees = degrees_of(config)
    rules = plan_rules(config.model, degrees)
    stacked = [v for v in _variables(config.model, padded_vocab(config.model, degrees[TENSOR]))
               if "layers" in (v.get_metadata().get("logical_axes") or ())]
    return sum(_shard_bytes(v, rules, degrees, 1) for v in stacked) // config.parallel.repeats


def _dense_experts(config: Config, rows: int, s: int, routed: tuple[float, float], fix: Corrections
                   ) -> tuple[float, float]:
    """A dense `ragged_dot` (every local expert over all of a microbatch's routed rows M = rows·s·k, padded under
    expert parallelism): the float32 buffers a backward through one MoE layer's experts holds, (input side, weight
    side) = (`expert_hidden_buffers` × [X/ep, M, F/t], `expert_model_buffers` × [X/ep, M, h]) of `fix`."""
    m, p = config.model, config.parallel
    moe = m.moe
    experts_rows = (moe.n_experts // p.expert) * rows * s * moe.top_k * routed[0] * 4
    return (fix.expert_hidden_buffers * experts_rows * (moe.d_ff // p.tensor),
            fix.expert_model_buffers * experts_rows * m.d_model)


def _table_branch(config: Config, local: ModelConfig, s: int, rows: int, kinds, routed, fix: Corrections) -> float:
    """What the running branch of a schedule table's tick holds beyond the switch's outputs (the working set): W
    replays each period of layers under a checkpoint that saves nothing, whatever the remat, and B recomputes what
    the stash lacks — either holds one layer's activations as a plain backward would. With `fix.dense_experts`, for
    MoE layers, the dense expert buffers besides (`_dense_experts`: B the input side — under the tape the experts'
    group is one SwiGLU whose hidden is not kept, so B runs its forward again beside its backward — W the weight
    side); with `fix.stacked_temporaries`, where the chunk's layers run as a loop of several trips, the loop body's
    temporaries sit on the branch's, which hold B's zero gradients for the chunk's matmul weights (a chunk's
    weights: B derives none, but returns every gradient the switch does), and the two add; inlined (one trip) they
    share the branch's heap."""
    layer = rows * max(_scaled(residuals(local, s, "none", k).layer, config, s, routed) for k in set(kinds))
    looped = fix.stacked_temporaries and _layers_loop(config, len(kinds), single=True)  # kinds: the chunk's layers
    inputs, weights = _dense_experts(config, rows, s, routed, fix) if any(kinds) else (0.0, 0.0)
    join = (lambda a, b: a + b) if looped else max
    b_branch = join(layer, inputs) + (_stage_weights(config) if looped else 0)
    return max(b_branch, join(layer, weights))


def activation_bytes(config: Config, backend: str = "gpu") -> dict[str, float]:
    """Activations saved for the backward, per device: {'layers', 'outside', 'loop', 'working_set'} (see the
    docstring); `working_set` (the unit of `WORKSPACE`) is one layer's activations without remat where the backward
    runs a layer at a time on top of what is saved (under remat, a loop's trip, a schedule table's B and W), and on
    'cpu' the dense MoE expert buffers of one layer."""
    m, p, t = config.model, config.parallel, config.train
    fix = corrections(backend)
    if fix.float32_activations and m.dtype != "float32":
        m = dataclasses.replace(m, dtype="float32")
    degrees = degrees_of(config)
    local = local_model(m, degrees)
    b = expected.rows_per_data_shard(config)
    s = t.seq_len // p.context
    A = t.grad_accum
    h = m.d_model * jnp.dtype(m.dtype).itemsize  # bytes of one token of the residual stream
    routed = _routed_factor(config, fix)
    loop = 0.0  # the pipeline loop's own buffers
    saved = None  # the activations kept for the backward (a table's slots: counted where the table is read)
    if p.pipe > 1:
        mb = b // p.microbatches // A
        k = m.pipelined_layers // (p.pipe * p.repeats)  # a dense prefix runs beside the embedding
        kinds = m.layer_kinds[m.prefix_layers:][:k]
        layer_rows, outside_rows = mb, b // p.pipe // A
        looped = True
        if p.schedule == "circular":
            # Autodiff of the loop stacks every iteration's residuals, and the weights each one read: the pass
            # r = ⌊(t − s)/m⌋ is a traced index, so a[r] is a value of the iteration, not an argument.
            layers = pipeline.iterations(p.pipe, p.repeats, p.microbatches)
            loop += layers * _stage_weights(config)
            # The carries io [q, mb, s, h], shift [mb, s, h] and park [m, mb, s, h] (v > 1, m > p), and in the
            # backward their cotangents alike.
            q = p.microbatches // p.pipe
            park = p.microbatches if p.repeats > 1 and p.microbatches > p.pipe else 0
            loop += 2 * (q + 1 + park) * mb * s * h / (p.tensor if p.sequence_parallel else 1)
        else:
            # The executor's buffers (`schedule.Program`, each with one scratch slot) hold a chunk's slot contents
            # as its own trace has them (`table_chunk`: the stash until B, the tape until W, dys from B until W)
            # and the inbox's messages [mb, s, h]. The tick's `switch` returns one of each besides — the F
            # branch's stash and tape, B's dys, the message — with the chunk's and `rest`'s gradients (every
            # branch returns them all, zeros where it computes none), written into the buffers after it; and for
            # v > 1 the tick takes its chunk's parameters out of the stage's [v, …] (a dynamic slice).
            prog = pipeline.Pipeline(p.pipe, p.repeats, p.microbatches, m.pipelined_layers, p.schedule).program
            chunk = table_chunk(local, s, p.remat, k)
            stash = k * mb * _scaled(chunk.stash, config, s, routed)
            # The tape and dys as the groups see them, the rank's s/c tokens under context parallelism; under SP
            # the column groups' inputs and the row groups' outputs (the stream, [mb, s/t, h]) split over `tensor`,
            # the row groups' inputs and the column groups' outputs whole-sequence. The tape keeps the groups'
            # inputs in the program's own dtypes, which XLA:CPU keeps too (bf16 values are bf16 buffers; what it
            # widens is arithmetic — matmul outputs, and so the stash and dys): the stream's float32 where a group
            # casts its input itself, and under SP the compute dtype (the entry casts the shard it gathers).
            split = p.tensor if p.sequence_parallel else 1
            compute = jnp.dtype(config.model.dtype).itemsize
            tape_entries = table_chunk(local_model(config.model, degrees), s, p.remat, k).tape
            tape = k * mb * sum(math.prod(e.shape) * compute / split if split > 1 and e.tag in STREAM else e.nbytes
                                for e in tape_entries)
            dys = k * mb * sum(e.nbytes / (split if e.tag in STREAM else 1) for e in chunk.dys)
            msg = mb * s * h / split  # the message: a chunk's output or its gradient, the stream
            saved = (prog.n_stash + 1) * stash + (prog.n_tape + 1) * tape
            weights = _stage_weights(config)
            rest = param_bytes(config) - p.repeats * weights  # the embedding, final norm and head
            loop += (prog.n_dys + 1) * dys + (prog.n_inbox + 1) * msg
            loop += stash + tape + dys + msg + weights + rest + (weights if p.repeats > 1 else 0)
            if fix.stacked_temporaries and A > 1:
                # The step's own temporaries after the accumulation loop — the summed gradients scaled, and
                # reduced over `data` — sit above the loop's, which hold the executor's gradient sums: one more
                # whole gradient.
                loop += param_bytes(config, 1)
            # The last chunk's F runs the head and the loss on its microbatch: one microbatch's at a time, in the
            # F branch (beside B's and W's working sets, not on top: `_table_branch`).
            outside_rows = mb
    else:
        layer_rows = outside_rows = b // A
        layers, kinds = 1, m.layer_kinds
        looped = _layers_loop(config, m.n_layers)
    # Traced for one row: every residual is [rows, …] (or [rows·s, …]), so the bytes scale with the rows.
    traced = {k: residuals(local, s, p.remat, k) for k in set(kinds)}
    if saved is None:
        # A loop's stacked residuals are what the trace stacks: the experts' rows as the trace has them (EP's padding
        # applies). Only an inlined run of layers keeps XLA:CPU's dense `ragged_dot` rows X/ep times beside the
        # backward (measured: bench/RESULTS.md, "Planner memory: the XLA:CPU corrections").
        kept = (routed[0], routed[0]) if looped else routed
        per_kind = {k: _scaled(r.stacked if looped else r.layer, config, s, kept) for k, r in traced.items()}
        saved = layers * layer_rows * sum(per_kind[k] for k in kinds)
        if p.skip_bubble:  # (the config allows it only on a circular pipeline)
            # `parallel.skip_bubble`: XLA's conditional takes operands and gives results as buffers of its own, so
            # an iteration's residuals are copied out of the forward's branch and into the backward's beside the
            # stacked ones. Two iterations' worth: measured on XLA:CPU +8, +21 and +38 MB against 5.5, 16.6 and
            # 16.6 MB an iteration (tiny preset; deepseek_tiny over pipe 2 with and without MTP).
            loop += 2 * saved / layers
    first = traced[kinds[0]]
    outside = outside_rows * _scaled(first.outside, config, s)
    if p.pipe > 1 and p.schedule == "circular" and m.prefix_layers:
        # DeepSeek's dense prefix, beside the embedding on the stage's own rows: autodiff keeps its residuals (a
        # table's B recomputes them from the tokens, in the embedding's vjp)
        outside += m.prefix_layers * outside_rows * _scaled(residuals(local, s, p.remat, False).layer, config, s)
    if m.mtp_depth:
        # each MTP module beside the head: an embedding, a layer of the model's kind, the head and its loss again
        # (counted as the outside's residuals and a layer's; a table's F runs them on one microbatch)
        mtp_layer = residuals(local, s, p.remat, m.moe.enabled).layer
        outside += m.mtp_depth * outside_rows * (_scaled(first.outside, config, s) + _scaled(mtp_layer, config, s))
    ring = p.context > 1 and p.context_impl == "ring"
    # The causal mask broadcast to the scores' shape, [rows, K, G, s, s] as bool and float32 (the tangent of the
    # masking `where`; a constant of the trace): a loop reads it as an input, held once (`Residuals.constant`), and
    # under remat, where the backward's recomputation reads it, XLA hoists it out of the loops alike — held once
    # (an unrolled program fuses it into its readers). The ring holds its own per step instead (`_ring_hoisted`);
    # a schedule table's branches (a `switch`, which XLA hoists nothing out of) build it where they read it.
    masks = [e for e in residuals(local, s, "none", kinds[0]).constant if len(e[0]) >= 4 and e[0][-2:] == (s, s)]
    constants = [e for e in first.constant if not (ring and e in masks)] if looped else []
    if looped and p.remat != "none" and not ring and (p.pipe == 1 or p.schedule == "circular"):
        constants += masks
    loop += layer_rows * _scaled(constants, config, s)
    if ring and looped:
        loop += _ring_hoisted(config, layer_rows, s)
    # The backward brings one layer's activations back at a time on top of the saved — under remat (recomputed)
    # and in a loop (a trip's temporaries, while the stacked residuals of every trip stay until the loop ends).
    trips = looped and (p.pipe == 1 or p.schedule == "circular")  # the executor's F branch counted above
    # Under `dots` the recomputed rest is elementwise on saved matmul outputs, which XLA fuses into the backward's
    # own kernels; what comes back as buffers are the attention scores and probabilities (batched matmuls, which
    # the policy does not save): the [.., s, s] entries.
    def recomputed(k) -> float:
        entries = residuals(local, s, "none", k).layer
        if p.remat == "dots":
            entries = [e for e in entries if len(e[0]) >= 4 and e[0][-2:] == (s, s)]
        return _scaled(entries, config, s, routed)

    if p.pipe > 1 and p.schedule != "circular":
        # the running branch: F (the head and the loss on its microbatch, for the last chunk), B or W
        none = max(_table_branch(config, local, s, layer_rows, kinds, routed, fix), outside)
        outside = 0.0
    else:
        none = 0.0 if p.remat == "none" and not trips else layer_rows * max(recomputed(k) for k in set(kinds))
        if fix.dense_experts and any(kinds):
            # A dense `ragged_dot`'s backward derives both the inputs' and the weights' gradients, so it holds the
            # larger of its two sides (a table splits them over B and W: `_table_branch`) where that is larger than
            # the layer's activations (which it reuses). Wide experts (Mixtral: F/t ≫ h/2) are input-bound;
            # fine-grained ones (DeepSeek-V3: F/t = 256 against h = 7168) weight-bound — deepseek_v3 on 256
            # simulated devices holds 3.3 [X/ep, M, h] float32 in its backward layer loop (bench/RESULTS.md).
            none = max(none, *_dense_experts(config, layer_rows, s, routed, fix))
    return {"layers": saved, "outside": outside, "loop": loop, "working_set": none}


def predict_memory(config: Config, backend: str = "gpu") -> Memory:
    """The step's memory per device for `config` resolved for its devices (`Config.resolve_for_devices`), compiled
    for `backend` (a `jax.Device.platform`: its `Corrections`, none but on 'cpu')."""
    state = state_bytes(config)
    act = activation_bytes(config, backend)
    return Memory(params=state["params"], optimizer=state["optimizer"], batch=state["batch"],
                  gradients=state["gradients"], activations=act["layers"] + act["outside"] + act["loop"],
                  workspace=WORKSPACE * act["working_set"])

