"""The matmul seam: every use of a weight matrix in the model goes through one small policy object.

The model never writes `x @ w.astype(dtype)` itself. It hands the stored parameter to the parallel context
(`par.column`, `par.row`, `par.embed`), and the context hands it to the `Einsum` of the weight's role at the one
place the contraction happens. That is the seam the weight formats plug into, the way gemma's `Einsum` module and
torchtitan's float8 converters do it:

    plain (this file)      stored float weight → cast to the activation's dtype → einsum, float32 accumulation
    int8 / int4 (this file) stored `Quantized(q, scale)` → dequantized to the activation's dtype → the same einsum
    fp8 (jaxpar.fp8)       `Fp8Rowwise`: e4m3 inputs and weights, e5m2 output gradients, scales per row,
                           float32 accumulation, the weight gradient in the compute dtype
    LoRA (this file)       stored `Adapted(W, A, B)` → x·W + (α/r)·(x·A)·B, W in whatever form it is stored
                           (float, or `Quantized`: QLoRA), A and B cast like any weight; in training with
                           dropout the context contracts (α/r)·(dropout(x)·A)·B apart (`LoRADropout`)

Policies are chosen per *role* (`ROLES`: attention, mlp, experts, router, embedding, head). Each matrix's family
`Param` carries its role, the model names the same role where it calls the context (`par.column(…, "mlp")`), and
the plan binds a `Policies` table (`make_plan(…, matmul=Policies.blocks(fp8))`) that `Parallel` holds: so FP8 or
LoRA can take the block's matmuls while the router, the embedding and the LM head stay in float. Every role is
plain by default.

Tensor parallelism wraps the policy rather than replacing it: a column-parallel group applies its entry collective
(f or the sequence all-gather) and then this policy per weight; a row-parallel matmul applies this policy and then
its exit collective. So a new weight format is one new policy class and touches neither the model nor the
collectives.

The policy must be hashable (a frozen dataclass): the sequence-parallel matmul group is a `custom_vjp` that takes it
as a static argument.

A policy is `operand` (the stored weight → what the contraction reads: a function of the weight alone, idempotent)
then `contract` (activations × prepared operand, linear in the activations). What stays exact where, for a scaled
format such as FP8 with per-tensor scales:

- Collective matmul (jaxpar.parallel.overlap) contracts the sequence chunk by chunk around a ring. It runs
  `operand` once per weight before the ring, and in its backward takes one vjp of `operand` (at the stored weight)
  on the chunks' summed weight gradient; each chunk is only `contract`, and the input gradient is the vjp of
  `contract` at one primal of the input's shape. So a weight-side scale (from the weight's amax, or from an amax
  history kept as a `model.Buffer`) is computed once and every chunk contracts the very operand the plain path
  contracts: exact.
- A scale on the *activations* or on the output gradients (FP8's e4m3 inputs, e5m2 gradients) must not be taken
  from the operand the contraction sees: a chunk's amax is not the tensor's, and the ring's input-gradient vjp is
  taken at a stand-in primal. Such a scale is state (delayed scaling: an amax history, a Buffer, updated after the
  step from amaxes reduced over every mesh axis that splits the tensor), an input of `contract`, not a function of x.
- The same holds for the pipeline executor, which prepares a chunk's weights once a tick by their roles (the tape
  records each group's role) and runs the model on them: `operand` applied again must change nothing.
- Under tensor parallelism `operand` sees this rank's shard: a scale computed from the shard is per shard. A
  whole-tensor scale (DESIGN's contract: the same numbers on every layout) is reduced over exactly the mesh axes
  that split the weight — outside the policy, with the state that holds it.

Token dimensions are flattened before the contraction. The model's activations are [B, T, ...]; contracted as they
are, the weight gradient of `btd,df->btf` contracts two dimensions (b and t), and XLA's CPU compiler lays that dot
out by physically transposing the [B, T, F] gradient inside a loop fusion, at a cache miss per element — on the tiny
model those transposes were a quarter of the whole single-device step. Contracting tokens as one dimension N = B·T
(a free reshape of the leading, row-major dimensions) gives every dot one contracting dimension and no transpose, on
every backend; the products and sums are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quantized:
    """A weight matrix stored as integers with float32 scales (weight-only quantization, symmetric):

        W ≈ q · scale,  q int8 in [-127, 127] or int4 in [-7, 7]

    scale has q's rank: each dim of q of size d is split into scale's n groups of d/n consecutive entries (n = d:
    every entry its own, an output channel; n = 1: one group across the dim, a contracted dim of int8's per-channel
    scale). `families.base.Param.scale` gives the shape from the matrix's contracted dims; nothing here needs them.

    A pytree of two arrays: the layer scan slices both, shard_map gives each rank its share of both (the scale's
    logical axes follow its weight's), and `Einsum.operand` dequantizes at the one place the contraction reads it.
    Layer parameters arrive in this form from `model.Blocks.stacked` (`name` and `name_scale`)."""

    q: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype) -> Array:
        """q · scale in `dtype` (the product in float32, then rounded once)."""
        w = self.q.astype(jnp.float32).reshape(_split(self.q.shape, self.scale.shape))
        w = w * self.scale.astype(jnp.float32).reshape([x for n in self.scale.shape for x in (n, 1)])
        return w.reshape(self.q.shape).astype(dtype)


QUANT_DTYPES = {"int8": (jnp.int8, 127), "int4": (jnp.int4, 7)}  # format → (storage dtype, largest |q|)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("base", "a", "b"), meta_fields=("scale", "name"))
@dataclasses.dataclass
class Adapted:
    """A weight matrix with low-rank adapters (LoRA, Hu et al. 2021): W_eff = W + scale·A·B, contracted unmerged as
    x·W + scale·(x·A)·B — the base W [in…, out…] frozen (float or `Quantized`), A [in…, r] and B [r, out…] trained,
    scale = alpha / r. The product is never formed: the adapter's cost is O(tokens·r·(in + out)), and no gradient
    of W is derived.

    Under tensor parallelism A and B shard as the dims they share with W do: a column-parallel W (heads or the MLP
    width split) has A whole and B split like W's outputs; a row-parallel W has A split like W's inputs and B whole,
    so (x·A_local)·B is a partial sum that joins W's in the same all-reduce. Layer parameters arrive in this form
    from `model.Blocks.stacked` (`name`, `name_lora_a`, `name_lora_b`); `name` is the weight's (LoRA dropout draws
    each weight's mask apart: `LoRADropout`)."""

    base: object
    a: Array
    b: Array
    scale: float
    name: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def ndim(self) -> int:
        return self.base.ndim


@functools.lru_cache(maxsize=None)
def lora_equations(equation: str) -> tuple[str, str]:
    """The two contractions of an adapter for a weight contracted by `equation` ("btd,dhe->bthe"): x·A over W's
    input dims ("btd,dr->btr") and (x·A)·B into W's output dims ("btr,rhe->bthe"). W's input dims lead its
    subscripts (families.base.Param.contract)."""
    inputs, out = equation.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    ins = "".join(c for c in ws if c in xs)
    outs = ws[len(ins):]
    if ws != ins + outs or any(c not in out for c in outs):
        raise ValueError(f"{equation}: a weight's contracted dims must lead its subscripts for an adapter")
    r = next(c for c in "rzyxwvuqponmlkjig" if c not in equation)
    rest = "".join(c for c in xs if c not in ins)
    return f"{xs},{ins}{r}->{rest}{r}", f"{rest}{r},{r}{outs}->{out}"


def mix32(x: Array) -> Array:
    """A bijection of uint32 with full avalanche (Wellons' lowbias32): every output bit depends on every input bit,
    so consecutive inputs (token coordinates, feature indices) give unrelated outputs."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


@dataclasses.dataclass(frozen=True)
class LoRADropout:
    """LoRA dropout (PEFT's lora_dropout) as a function of global coordinates, so that every layout drops the same
    entries: an adapter reads dropout(x) = x·keep/(1 − rate) in place of x (the base weight reads x), and

        keep[token, feature] = mix(mix(coord[token] ^ w) ^ mix(feature·φ + w)) ≥ rate·2³²
        w = mix(layer ^ crc32(name))

    coord: the token's place in the run (`jaxpar.train.step`: (step·B + row)·(T+1) + position, offset by the seed),
    layer: its layer's seed (`jaxpar.model.layer_seeds`: the stack and the layer's index in it), name: the weight's,
    feature: the entry's index in the weight's whole input (a row-parallel weight's rank adds its offset). Nothing
    depends on which rank holds the token, the layer or the feature, nor on how rows are cut into microbatches.

    coords uint32 [B, T(/c)]: the tokens this context's activations hold (the step's share under context
    parallelism); layer: uint32 scalar, set per layer by `jaxpar.model.run_layers` (`Parallel.at_layer`)."""

    rate: float
    coords: Array
    layer: Array | None = None

    def __call__(self, x: Array, name: str, coords: Array, offset: Array | int = 0) -> Array:
        """x [B, T, *features] (compute dtype) with its tokens' coords [B, T] → x with the dropped entries zero and
        the rest scaled by 1/(1 − rate). offset: the global index of x's first entry along its first feature dim."""
        if self.layer is None:
            raise ValueError("LoRA dropout outside a layer: run_layers sets each layer's seed (Parallel.at_layer)")
        w = mix32(self.layer ^ np.uint32(zlib.crc32(name.encode())))
        feats = x.shape[2:]
        # each entry's flat index over the whole input's feature dims (only the first may be split over ranks)
        index, stride = jnp.zeros(feats, jnp.uint32), 1
        for d in reversed(range(len(feats))):
            i = jax.lax.broadcasted_iota(jnp.uint32, feats, d)
            if d == 0:
                i = i + jnp.asarray(offset).astype(jnp.uint32)
            index, stride = index + i * np.uint32(stride), stride * feats[d]
        feat = mix32(index * np.uint32(0x9E3779B9) + w)
        tok = mix32(coords.astype(jnp.uint32) ^ w).reshape(*coords.shape, *[1] * len(feats))
        keep = mix32(tok ^ feat) >= np.uint32(min(round(self.rate * 2.0**32), 2**32 - 1))
        return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - self.rate), x.dtype), jnp.zeros((), x.dtype))


def _split(shape, groups) -> list[int]:
    """Each dim d of `shape` as (n, d/n) for its n groups."""
    return [x for d, n in zip(shape, groups) for x in (n, d // n)]


def quantize(w: Array, scale_shape: tuple[int, ...], fmt: str) -> Quantized:
    """Round w to `fmt` ('int8' / 'int4') with one symmetric scale per group of `scale_shape` (`Quantized`):
    scale = max |w| over the group / qmax (1 for an all-zero group), q = round(w / scale)."""
    dtype, qmax = QUANT_DTYPES[fmt]
    x = w.astype(jnp.float32).reshape(_split(w.shape, scale_shape))
    amax = jnp.abs(x).max(axis=tuple(range(1, x.ndim, 2)), keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = jnp.clip(jnp.round(x / scale), -qmax, qmax).astype(dtype).reshape(w.shape)
    return Quantized(q, scale.reshape(scale_shape))


@dataclasses.dataclass(frozen=True)
class Einsum:
    """The plain policy: the stored weight (float32 master, or whatever `param_dtype` is) is cast to the activation's
    dtype — the compute dtype, bf16 on GPUs — and contracted with float32 accumulation.

    A policy is two steps, and a new one overrides either: `operand` prepares a stored weight (cast, dequantize,
    quantize-dequantize at a scale) and `contract` contracts activations with prepared operands. `__call__` is the
    two in a row; the collective matmul prepares once and contracts each ring chunk (see the module docstring).

    whole_output_grad: the policy's input gradient is not linear in the output gradient (FP8 quantizes dy with a
    scale over the whole output), so a kv head that several tensor ranks share must have its gradient summed
    before the matmul, not after (`Parallel.kv_output`)."""

    whole_output_grad = False  # a class constant, not a field

    def __call__(self, equation: str, x: Array, w: Array) -> Array:
        """einsum(equation, x, w) → float32. x is already in the compute dtype; w as stored (or as `operand`
        made it: applying that again changes nothing)."""
        return self.contract(equation, x, self.operand(w, x.dtype))

    def operand(self, w: Array, dtype) -> Array:
        """The stored weight as the contraction reads it, for activations in `dtype` (a `Quantized` one
        dequantized). A function of w alone, and idempotent: operand(operand(w)) = operand(w). (The pipeline
        executor prepares a chunk's weights with it once a tick and runs the model on them, so what its backward
        closes over is one copy; the model's own call prepares them again, which must change nothing.)"""
        if isinstance(w, Adapted):
            return dataclasses.replace(w, base=self.operand(w.base, dtype), a=w.a.astype(dtype), b=w.b.astype(dtype))
        return w.dequantize(dtype) if isinstance(w, Quantized) else w.astype(dtype)

    def contract(self, equation: str, x: Array, w: Array, x_scale: Array | None = None) -> Array:
        """einsum(equation, x, w) → float32 on a prepared operand w. Linear in x — or, for a scaled format, with an
        input gradient that does not depend on x —: the collective matmul's backward takes its vjp with respect to
        x once, at any primal of x's shape. An `Adapted` operand adds its adapters' scale·(x·A)·B, the rank-r
        activation x·A rounded to x's dtype between the two (as PEFT's lora_B(lora_A(x))), always by the plain
        product: the adapters are small and train in the compute dtype. x_scale: what `scales(…, "input")` took
        from the whole tensor x is a chunk of (a ring's), cut like x; None: the policy takes it from x itself."""
        if isinstance(w, Adapted):
            down, up = lora_equations(equation)
            low = token_einsum(down, x, w.a).astype(x.dtype)
            return self.contract(equation, x, w.base, x_scale) + w.scale * token_einsum(up, low, w.b)
        return self.product(equation, x, w, x_scale)

    def product(self, equation: str, x: Array, w: Array, x_scale: Array | None = None) -> Array:
        """The contraction of x with one prepared array w (`contract` without adapters) → float32."""
        return token_einsum(equation, x, w)

    def scales(self, equation: str, v: Array, side: str) -> Array | None:
        """What the policy scales a whole activation (side "input": x of `contract`) or output gradient ("output")
        by, per token, for a ring to cut beside the tensor (collective matmul contracts chunks of tokens, different
        ones on each rank at a time, so a scale reduced over ranks must be taken before the cut). None: no scales
        (the plain policy)."""
        return None

    def input_grad(self, equation: str, dy: Array, w: Array, x: Array, dy_scale: Array | None = None) -> Array:
        """The gradient of `contract(equation, x, w)` with respect to x for output gradient dy (float32), at any x
        of the input's shape and dtype (it does not depend on x); dy_scale: `scales(…, "output")` of the whole
        output gradient dy is a chunk of, cut like dy."""
        _, vjp = jax.vjp(lambda x_: self.contract(equation, x_, w), x)
        return vjp(dy)[0]

    def along(self, inputs: str | None = None, outputs: str | None = None) -> "Einsum":
        """This policy for a weight whose input (contracted) dims are split over mesh axis `inputs` (a
        row-parallel weight) or whose output dims are split over `outputs` (column-parallel): tensor parallelism
        says so where it contracts (jaxpar.parallel.tensor). A policy whose scales span a whole dim (FP8's) reduces
        them over that axis; the plain policy needs nothing."""
        return self

    def ragged(self, x: Array, w: Array, group_sizes: Array) -> Array:
        """Grouped matmul (the experts of an MoE layer): rows x [M, K] sorted by group, w [G, K, N], group_sizes
        [G] → float32 [M, N], row i times w[its group]; rows past Σ group_sizes give zeros."""
        return jax.lax.ragged_dot(x, self.operand(w, x.dtype), group_sizes, preferred_element_type=jnp.float32)

    def table(self, w: Array, dtype) -> Array:
        """A weight read by rows (the embedding lookup) in the compute dtype `dtype`."""
        return w.astype(dtype)


PLAIN = Einsum()

# The roles a weight matrix is contracted under (`families.base.Param.role` says each parameter's; the model names
# the role at each call of the seam). A shared expert is a dense MLP every token passes: `mlp`; a shared expert's
# sigmoid score is a gate like the router's: `router`. The LM head is `head` even when tied to the embedding.
ROLES = ("attention", "mlp", "experts", "router", "embedding", "head")
BLOCK_ROLES = ("attention", "mlp", "experts")  # the matmuls FP8 and LoRA are for; the rest stay float by default


@dataclasses.dataclass(frozen=True)
class Policies:
    """The matmul policy of each role (`ROLES`): a hashable table the plan binds and `Parallel` holds. A role left
    out is contracted by `PLAIN`.

        Policies()                          every role plain (the reference)
        Policies.of(mlp=Fp8())              one role
        Policies.blocks(Fp8())              the block's matmuls (attention, mlp, experts); router, embedding and
                                            head stay float
    """

    bound: tuple[tuple[str, Einsum], ...] = ()  # (role, policy), in ROLES order

    def __post_init__(self):
        roles = [role for role, _ in self.bound]
        unknown = sorted(set(roles) - set(ROLES))
        if unknown or len(set(roles)) != len(roles):
            raise ValueError(f"matmul roles {roles}: each at most once, from {ROLES}")
        object.__setattr__(self, "bound", tuple(sorted(self.bound, key=lambda b: ROLES.index(b[0]))))

    @classmethod
    def of(cls, **by_role: Einsum) -> "Policies":
        """A table binding each named role to its policy (the others plain)."""
        return cls(tuple(by_role.items()))

    @classmethod
    def blocks(cls, policy: Einsum) -> "Policies":
        """`policy` for the transformer block's matmuls (`BLOCK_ROLES`), plain for the router, embedding and head."""
        return cls(tuple((role, policy) for role in BLOCK_ROLES))

    @classmethod
    def every(cls, policy: Einsum) -> "Policies":
        """`policy` for every role."""
        return cls(tuple((role, policy) for role in ROLES))

    def for_role(self, role: str) -> Einsum:
        """The policy that contracts the weights of `role`."""
        if role not in ROLES:
            raise ValueError(f"matmul role {role!r}: expected one of {ROLES}")
        return dict(self.bound).get(role, PLAIN)


@functools.lru_cache(maxsize=None)
def _flattened(equation: str) -> tuple[int, str]:
    """(k, equation') where x's first k letters are token dimensions — absent from the weight and leading the
    output in the same order — and equation' contracts them as one (k < 2: nothing to flatten, equation unchanged)."""
    inputs, out = equation.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    k = 0
    while k < len(xs) and xs[k] not in ws and out[k : k + 1] == xs[k]:
        k += 1
    if k < 2:
        return 0, equation
    n = next(c for c in "NMLKJ" if c not in equation)
    return k, f"{n}{xs[k:]},{ws}->{n}{out[k:]}"


def token_einsum(equation: str, x: Array, w: Array) -> Array:
    """einsum(equation, x, w) with float32 accumulation, the leading token dimensions of x (e.g. b, t) contracted
    as one (see the module docstring for why)."""
    k, flat = _flattened(equation)
    if not k:
        return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    y = jnp.einsum(flat, x.reshape(-1, *x.shape[k:]), w, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:k], *y.shape[1:])
