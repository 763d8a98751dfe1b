"""The parallel plan: one object that says how a model runs on a set of devices, built and validated once.

`make_plan(model, parallel, devices)` turns the config and the devices (or an existing mesh) into a `Plan`: the
mesh over the axes of `jaxpar.parallel.axes`, the degree of each axis, the logical → mesh rules for this model
(with the GQA exception), the vocab padded for the tensor degree, and what each strategy needs — the tensor-parallel
boundaries the model calls (`plan.tensor`), the circular pipeline's counts (`plan.pipeline`), the ZeRO stage, the
batch's layout and the axes gradients are averaged over. Every combination that cannot run, or that would run and
silently do something else, is refused here (or, when no device count is needed, by `jaxpar.config`) with a
`ConfigError` that names the field.

`make_plan(model)` (no devices) is the single-device reference: no mesh, plain computations, unpadded vocab.

    config ─► make_plan ─► Plan ─► create_state (rules, zero, stack_order, padded_vocab)
                                ─► the step (tensor, pipeline, batch_spec, grad_axes) under shard_map on plan.mesh
                                ─► checkpoints (stack_order, padded_vocab) and the data loader (batch_spec)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax

from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, resolve_attention
from jaxpar.families import attention_kind
from jaxpar import fp8
from jaxpar.matmul import Policies
from jaxpar.mesh import make_mesh
from jaxpar.parallel.axes import (AXES, BATCH_AXES, CONTEXT, DATA, EXPERT, GRAD_AXES, MESH_AXES, PIPE, RULES, SEQ_AXES,
                                  TENSOR, MeshAxes)
from jaxpar.parallel.context_parallel import ContextParallel
from jaxpar.parallel.expert import ExpertParallel
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.parallel.context import Parallel
from jaxpar.parallel.tensor import TensorParallel
from jaxpar.sharding import logical_to_spec, pad_vocab, permute_layers

BATCH = ("batch", None)  # logical axes of a token batch [B, T+1]: rows split, tokens whole


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one model sits on one mesh (mesh None: the single-device reference).

    degrees: {mesh axis: size}, in table order (all 1 without a mesh).
    rules: logical → mesh axes for this model (RULES with the GQA exception applied).
    padded_vocab: the vocab rounded up to a multiple of the tensor degree (Megatron's make-vocab-size-divisible-by:
        pad rows are zero and their logits masked, so the math is unchanged).
    model: the model config as it runs on these devices (attention 'auto' resolved to a kernel).
    tensor: Megatron tensor parallelism under shard_map (None without a mesh, and for GSPMD).
    context: context parallelism (the sequence split over `context`) when context > 1, else None.
    expert: where MoE experts live (split over `expert` when expert > 1).
    pipeline: the circular pipeline's counts when pipe > 1, else None.
    zero: ZeRO stage: 1 shards optimizer moments over `data`, 3 parameters too.
    explicit: the step runs under shard_map with our collectives; False leaves partitioning to GSPMD.
    matmul: the matmul policy of each weight role (jaxpar.matmul.Policies; every role plain by default), which
        `parallel` hands the model.
    """

    mesh: Mesh | None = None
    degrees: dict[str, int] = dataclasses.field(default_factory=lambda: {a: 1 for a in AXES})
    rules: tuple[tuple[str, MeshAxes], ...] = RULES
    padded_vocab: int | None = None
    tensor: TensorParallel | None = None
    pipeline: Pipeline | None = None
    zero: int = 0
    explicit: bool = True
    model: ModelConfig | None = None
    context: ContextParallel | None = None
    expert: ExpertParallel = ExpertParallel()
    matmul: Policies = Policies()

    @property
    def data(self) -> int:
        """The data degree (what ZeRO splits by)."""
        return self.degrees[DATA]

    @property
    def param_zero_data(self) -> int:
        return self.data if self.zero >= 3 else 1

    @property
    def opt_zero_data(self) -> int:
        return self.data if self.zero >= 1 else 1

    @property
    def layer_order(self) -> np.ndarray | None:
        """order[n] = the model layer at position n of a stack of all L layers in memory (None: model order) — a
        dense or all-MoE model's `blocks`; `stack_order` for a stack of any length."""
        return self.stack_order(self.model.pipelined_layers)

    def stack_order(self, n: int) -> np.ndarray | None:
        """order[i] = the entry of a stack of n layers (in model order) at position i of the stacked axis in memory
        (None: model order). The pipeline stores each stack on the `layers` logical axis stage-major
        (`Pipeline.stack_order`); the stacks a pipeline runs outside its stages (`prefix_layers`, `mtp_layers`:
        jaxpar.model.Blocks) stay in model order, and `permute_layers` leaves them alone."""
        return None if self.pipeline is None else self.pipeline.stack_order(n)

    @property
    def sharded(self) -> bool:
        """The step runs under shard_map on the mesh (else: one global computation, single device or GSPMD)."""
        return self.mesh is not None and self.explicit

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes that split a batch's rows (data, pipe, expert)."""
        return BATCH_AXES

    @property
    def grad_axes(self) -> tuple[str, ...]:
        """The mesh axes loss and gradients are averaged over: the batch axes but a running pipeline's `pipe` (whose
        stages' losses the pipeline step sums instead). Without a pipeline `pipe` has size 1 and stays in the tuple:
        the rows are split over it too, so the reduction must name it (check_vma), at no cost. With context
        parallelism, `context` too: its ranks each hold an equal share of every row's tokens, so their mean losses
        average to the step's."""
        return (GRAD_AXES if self.pipeline is not None else BATCH_AXES) + (SEQ_AXES if self.context else ())

    def from_canonical(self, params: nnx.State) -> nnx.State:
        """Canonical params (stacked layers in model order, the true vocab) → this plan's runtime layout: the vocab
        padded to `padded_vocab`, the layers in the pipeline's storage order. The one place that conversion is
        written: checkpoints, state creation and the tests all use it (and `to_canonical`, its inverse)."""
        params = pad_vocab(params, self.padded_vocab)
        return params if self.pipeline is None else permute_layers(params, self.stack_order)

    def to_canonical(self, params: nnx.State) -> nnx.State:
        """Runtime params (or gradients, or Adam moments) → model layer order and the model's true vocab size."""
        if self.pipeline is not None:
            params = permute_layers(params, lambda n: np.argsort(self.stack_order(n)))
        return pad_vocab(params, self.model.vocab_size)

    def without_pipeline(self) -> "Plan":
        """This plan with each stage's layers whole on every `pipe` rank: `pipe` then splits rows only, as `data`
        does (`batch_axes` keep it). For a forward pass beside a pipelined run that should not need the schedule:
        DPO's reference model (jaxpar.train.step.make_reference_step). Params move over with `to_canonical` here
        and `from_canonical` there."""
        if self.pipeline is None:
            return self
        rules = tuple((name, None if name == "layers" else axes) for name, axes in self.rules)
        return dataclasses.replace(self, pipeline=None, rules=rules)

    @property
    def parallel(self) -> Parallel:
        """The context the model calls at its parallel boundaries (jaxpar.parallel.context)."""
        return Parallel(self.tensor, context=self.context, expert=self.expert, matmul=self.matmul)

    @property
    def batch_spec(self) -> P:
        """Token batches [B, T+1]: rows over the batch axes, tokens whole."""
        return batch_spec()

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch [B, T+1] lives on the mesh."""
        return batch_sharding(self.mesh)


def batch_spec() -> P:
    """Token batches [B, T+1]: rows over the batch axes (data, pipe, expert), tokens whole. (No model-specific
    exception touches `batch`, so this is the table's rule alone.)"""
    return logical_to_spec(BATCH)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a global batch [B, T+1] lives on `mesh`: rows over the batch axes, tokens whole."""
    return NamedSharding(mesh, batch_spec())


def make_plan(model: ModelConfig, parallel: ParallelConfig | None = None, devices: Sequence | Mesh | None = None,
              explicit: bool = True, matmul: Policies | None = None) -> Plan:
    """The plan of `model` with `parallel` on `devices` — a list of devices (a mesh is built over them), an existing
    mesh with the axes of the table, or None for the single-device reference.

    explicit: the step runs under `shard_map` with our collectives (TensorParallel bound to 'tensor'); False leaves
    partitioning to GSPMD (the comparison baseline of bench/tp.py, and inference), which has no pipeline and no
    sequence parallelism: asking it for either is a ConfigError.

    matmul: the policy that contracts each weight role's matmuls (jaxpar.matmul.Policies: e.g.
    `Policies.blocks(fp8)` for the block's matmuls, router, embedding and head in float); default: the model's
    `model.matmul` for the block's roles (`model_policies`), every role plain for "float".
    """
    matmul = model_policies(model) if matmul is None else matmul
    if devices is None:
        return Plan(padded_vocab=model.vocab_size, explicit=explicit, model=resolve_attention(model, jax.devices()[0]),
                    matmul=matmul)
    if isinstance(devices, Mesh):
        mesh = devices
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"a plan's mesh must have the axes {AXES} in this order, not {mesh.axis_names}; "
                             "build it with jaxpar.mesh.make_mesh")
        parallel = ParallelConfig(**{a: int(mesh.shape[a]) for a in AXES}) if parallel is None else parallel
    else:
        parallel = ParallelConfig() if parallel is None else parallel
        mesh = make_mesh(parallel, list(devices))
    degrees = {a: int(mesh.shape[a]) for a in AXES}
    _validate(parallel, degrees, explicit)
    t = degrees[TENSOR]
    rules = plan_rules(model, degrees)
    kv_replicas = t // model.n_kv_heads if t > 1 and model.n_kv_heads % t else 1
    _check_scales(model, dict(rules), degrees)
    # At tensor = 1 the model runs the single-device context: a psum over a one-device axis is not free on every
    # backend (XLA:CPU keeps it as an all-reduce, with its rendezvous, in every layer, forward and backward).
    tensor = None
    if explicit and t > 1:
        tensor = TensorParallel(TENSOR, parallel.sequence_parallel, kv_replicas,
                                overlap=parallel.overlap == "collective_matmul")
    pipeline = None
    if degrees[PIPE] > 1:
        # the layers the stages split: all but a dense prefix, which runs beside the embedding (`prefix_layers`)
        pipeline = Pipeline(degrees[PIPE], parallel.repeats, parallel.microbatches, model.pipelined_layers,
                            parallel.schedule, parallel.skip_bubble)
    runs = resolve_attention(model, mesh.devices.flat[0])
    if tensor is not None and tensor.sequence:
        # One layer per scan iteration under SP: its backward gathers each layer's input again (Korthikanti et al.
        # §4.2.2), and in an unrolled body XLA's CSE merges that re-gather with the forward's gather and keeps the
        # full-sequence activation alive — the memory SP exists to save.
        runs = dataclasses.replace(runs, scan_unroll=1)
    context = None
    if degrees[CONTEXT] > 1:
        context = ContextParallel(CONTEXT, degrees[CONTEXT], parallel.context_impl)
    expert = ExpertParallel(EXPERT if degrees[EXPERT] > 1 else None, degrees[EXPERT])
    return Plan(mesh, degrees, rules, padded_vocab(model, t), tensor, pipeline, parallel.zero, explicit,
                runs, context, expert, matmul)


def model_policies(model: ModelConfig) -> Policies:
    """The matmul policies `model.matmul` asks for: a recipe of jaxpar.fp8 on the block's roles, or every role plain."""
    return Policies() if model.matmul == "float" else Policies.blocks(fp8.RECIPES[model.matmul])


def padded_vocab(model: ModelConfig, tensor: int) -> int:
    """The vocab rounded up to a multiple of the tensor degree (Megatron's make-vocab-size-divisible-by)."""
    return math.ceil(model.vocab_size / tensor) * tensor


def plan_rules(model: ModelConfig, degrees: dict[str, int]) -> tuple[tuple[str, MeshAxes], ...]:
    """The logical → mesh rules of `model` on these degrees: the table's, with a one-rank axis named nowhere (its
    values are typed, and run, as not varying over it) and the attention kind's exception: heads that several
    tensor ranks share (`AttentionKind.shared`; GQA with fewer kv heads than ranks, rank r using kv head r // (t/K))
    are held whole — its `shared_axes` split over nothing. Needs no devices: the planner reads it for meshes it has
    not."""
    rules = RULES
    if degrees[EXPERT] == 1:  # experts held whole: their gradients reduce like any replicated parameter's
        rules = tuple((name, None if axis == EXPERT else axis) for name, axis in rules)
    if degrees[TENSOR] == 1:  # nothing is split over tensor
        rules = tuple((name, None if axis == TENSOR else axis) for name, axis in rules)
    elif (kind := attention_kind(model)).shared(model, degrees[TENSOR]) > 1:
        rules = tuple((name, None if name in kind.shared_axes else axis) for name, axis in rules)
    return rules


def _check_scales(model: ModelConfig, rules: dict, degrees: dict[str, int]) -> None:
    """A quantized matrix's scale shards with its weight: where a dim keeps n groups (1 < n < the dim, int4 groups
    spanning several heads), each rank must hold whole groups, so the mesh axes splitting that dim must divide n."""
    for moe in set(model.layer_kinds):
        for name, spec in model.quantized_params(moe).items():
            scale = model.scale_param(spec)
            for n, d, axis in zip(scale.shape, spec.shape, spec.axes):
                mesh_axes = rules.get(axis) or ()
                mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
                split = math.prod(degrees[a] for a in mesh_axes)
                if 1 < n < d and n % split:
                    raise ConfigError("model.weight_group", model.weight_group,
                                      f"{name}'s groups span {d // n} of its {d} '{axis}' entries, and "
                                      f"{'*'.join(mesh_axes)} = {split} splits those {d} into shares of "
                                      f"{d // split}: a rank would hold part of a group",
                                      f"use a {'*'.join(mesh_axes)} degree dividing {n}, or quantize with a smaller "
                                      "model.weight_group (or int8)")


def _validate(parallel: ParallelConfig, degrees: dict[str, int], explicit: bool) -> None:
    """Refuse what cannot run on these degrees, or would run and silently do something else. (Checks that need no
    device count — degrees against the model, SP without TP, unimplemented axes — live in jaxpar.config.)"""
    for axis in MESH_AXES:  # a mesh given by the caller must be the one the config describes
        want = getattr(parallel, axis.name)
        if want != degrees[axis.name] and not (axis.name == DATA and want == -1):
            raise ConfigError(axis.field, want, f"the mesh has {axis.name} = {degrees[axis.name]}",
                              f"set {axis.field}={degrees[axis.name]}, or build the mesh from this config")
    if not explicit:
        # The GSPMD baseline is one global computation: it has no pipeline loop (with pipe > 1 the layers, stored in
        # pipeline order, would run in the wrong order) and no sequence-parallel boundaries. Refuse, don't pretend.
        if degrees[PIPE] > 1:
            raise ConfigError("parallel.pipe", degrees[PIPE], "the GSPMD baseline (explicit=False) runs no "
                              "pipeline", "compare against GSPMD at parallel.pipe=1, or use the explicit step")
        if parallel.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, "the GSPMD baseline (explicit=False) does not "
                              "implement sequence parallelism", "set parallel.sequence_parallel=false for it")
        if degrees[CONTEXT] > 1:
            raise ConfigError("parallel.context", degrees[CONTEXT], "the GSPMD baseline (explicit=False) does not "
                              "implement context parallelism", "compare against GSPMD at parallel.context=1")
        if degrees[EXPERT] > 1:
            raise ConfigError("parallel.expert", degrees[EXPERT], "the GSPMD baseline (explicit=False) does not "
                              "implement expert parallelism", "compare against GSPMD at parallel.expert=1")
    if parallel.zero and degrees[DATA] == 1:
        # ZeRO splits optimizer state (and at stage 3 parameters) over `data`: with one data rank it splits nothing.
        raise ConfigError("parallel.zero", parallel.zero, "ZeRO shards over the data axis, which has size 1 here "
                          "(nothing would be sharded)", "set parallel.zero=0, or use parallel.data > 1")
