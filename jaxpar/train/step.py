"""The train and eval steps: next-token loss, gradient accumulation, clipping and AdamW.

On a mesh, the loss and its gradients run under one `jax.shard_map` over the plan's mesh (jaxpar.plan): the
model sees local shards, and every collective is one we wrote —

    tensor:  Megatron f/g (or SP all-gather/reduce-scatter) inside each layer, the vocab-parallel embedding and loss
             (jaxpar.parallel.tensor / .sequence);
    pipe:    the circular pipeline's ppermutes (jaxpar.parallel.pipeline), an all-gather of the targets, and one psum
             of the gradients of parameters every stage holds (embedding, final norm, head);
    data:    one pmean of the loss and of the gradients after accumulation, over the plan's gradient axes (data,
             and expert, whose ranks are data-parallel outside MoE layers);
    expert:  the MoE layers' all-to-alls (jaxpar.parallel.expert). Experts split over `expert` are not averaged
             over it: each rank's experts already received the gradients of every rank's tokens through the
             all-to-all's transpose, so their sum is divided by the expert degree instead.

The optimizer update runs outside the shard_map under plain `jit` on the sharded state: it is elementwise except for
the global gradient norm, whose reduction the compiler inserts. Without a mesh the same code is the single-device
reference; a plan with `explicit=False` keeps the mesh but leaves tensor parallelism to GSPMD (the baseline of
bench/tp.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.matmul import mix32
from jaxpar.model import (buffers_of, default_positions, forward_buffers, frozen_of, layer_masks, layer_operands,
                          layer_seeds, learnable, merge_state, moe_objective, mtp_targets, run_layers, stats_total,
                          trainable)
from jaxpar.parallel import circular, executor, schedule as tables
from jaxpar.parallel.axes import DATA, EXPERT, PIPE
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.plan import Plan, batch_sharding
from jaxpar.parallel.context import SINGLE_DEVICE, Parallel
from jaxpar.parallel.vma import vary
from jaxpar.sharding import constrain
from jaxpar.train import dpo as preference
from jaxpar.train.dpo import DPO
from jaxpar.train.state import TrainState

Metrics = dict[str, jax.Array]

# A batch is token rows int [B, T+1], or a dict of [B, T+1] arrays: "tokens", and optionally
#   "mask"      0/1: mask[:, t] says whether token t is scored as a target (SFT scores the assistant's tokens only);
#               column 0 is never a target (no token comes before it);
#   "segments"  packed documents: one id per document (1, 2, …; 0 for padding). Attention stays inside a document,
#               positions restart at each one, and a token is a target only of the token before it in its own
#               document (the first token of a document is nobody's target; padding never is);
#   "ref"       DPO (`dpo`): float32 [B, 2], the reference model's summed log-probabilities of each row's pair of
#               answers (segments 1 and 2: jaxpar.train.dpo), per row — not cut along the sequence;
#   "coords"    LoRA dropout (`lora.dropout` > 0, training only): uint32, each token's place in the run, from which
#               its dropout masks are drawn (`dropout_coords`; jaxpar.matmul.LoRADropout).
# All are cut along rows alike (data, pipe, accumulation) and along the sequence alike (context), so every piece of a
# step carries the mask and the documents of its own tokens.
Batch = jax.Array | dict[str, jax.Array]
BATCH_KEYS = ("tokens", "mask", "segments", "ref", "coords")


def rows_of(batch: Batch) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """(token rows int [B, T+1], the loss mask [B, T+1] or None, the segment ids [B, T+1] or None) of a batch."""
    if isinstance(batch, dict):
        unknown = set(batch) - set(BATCH_KEYS)
        if unknown or "tokens" not in batch:
            raise ValueError(f"a batch holds 'tokens' and optionally {BATCH_KEYS[1:]}, not {sorted(batch)}")
        return batch["tokens"], batch.get("mask"), batch.get("segments")
    return batch, None, None


def target_weights(batch: Batch) -> jax.Array | None:
    """float32 [B, T]: which next-token targets count — the mask's, and with segments only targets in their
    predecessor's document (not padding) — or None when every target counts."""
    _, mask, segments = rows_of(batch)
    weights = None if mask is None else mask[:, 1:].astype(jnp.float32)
    if segments is not None:
        inside = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)).astype(jnp.float32)
        weights = inside if weights is None else weights * inside
    return weights


def target_density(batch: Batch) -> jax.Array:
    """The share of the batch's target slots [B, T] that count: Σ w / (B·T) of `target_weights`, float32 (1 when
    every target counts). Computed on the whole global batch — under jit over its sharded array, so the compiler
    sums over the devices — it turns every local mean over equal-sized pieces into the one global masked mean
    (`masked_mean`)."""
    weights = target_weights(batch)
    return jnp.float32(1.0) if weights is None else weights.mean()


def segment_positions(segments: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's position inside its document, segments [B, T] (a document is a run of equal
    ids): t minus the index where its run started."""
    T = segments.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class Share(NamedTuple):
    """What a rank scores of a batch of rows [B, T+1] (`sequence_share`), each [B, T] (T/c under context
    parallelism, zigzag order): tokens, next-token targets, positions (inside each document when packed), the
    targets' weights (None: all count), the tokens' segment ids (None: one document a row) and their LoRA dropout
    coordinates (None: no dropout)."""

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array
    weights: jax.Array | None
    segments: jax.Array | None
    coords: jax.Array | None = None


def masked_mean(ce: jax.Array, weights: jax.Array | None, density: jax.Array | None) -> jax.Array:
    """The loss of this piece of the step: ce [R, T_local] (nats per target) → its mean, or with weights (the mask
    of these targets) mean(ce · w) / density.

    Why that is exact everywhere: the step's pieces — data shards, pipeline stages' held rows, accumulation chunks,
    context ranks' sequence parts — all have the same number of target slots, and the step averages them (pmean,
    a 1/p-scaled psum, the mean of chunk means). The average of Σ_piece(ce·w)/slots_piece is Σ(ce·w)/slots, and
    density = Σw/slots for the whole step, so dividing by it leaves Σ(ce·w)/Σw: the masked mean over every target
    of the global batch, as one device computes it. (A step with no target at all gives 0, not 0/0.)"""
    if weights is None:
        return ce.mean()
    return (ce * weights).mean() / jnp.maximum(density, jnp.finfo(jnp.float32).tiny)


def head_loss(logits: jax.Array, held: Share, rows: Batch, density: jax.Array | None, par: Parallel,
              dpo: DPO | None = None) -> tuple[jax.Array, dict]:
    """The loss of some rows from their logits [R, T(/c), V_local] and `Share` `held` (rows: the rows themselves,
    [R, T+1] each) → (the (masked) mean cross-entropy, {}), or with `dpo` the preference loss of the pairs the rows
    hold against their "ref" sums (jaxpar.train.dpo) and the sums it reports, {"dpo": …}. Wherever rows are
    scored: the whole step's on one device, a stage's held microbatches, a schedule table's head."""
    ce = par.cross_entropy(logits, held.targets)  # [R, T(/c)]
    if dpo is None:
        return masked_mean(ce, held.weights, density), {}
    logps, counts = preference.completion_logps(ce, held.weights, held.segments, par)
    shares = 1 if par.context is None else par.context.degree  # ranks that hold the same pairs' sums
    loss, sums = preference.pair_loss(logps, counts, rows["ref"], dpo, shares)
    return loss, {"dpo": sums}


def check_pairs(batch: Batch) -> None:
    """DPO scores pairs: a batch with "mask", "segments" (1: chosen, 2: rejected) and "ref" (`Batch`)."""
    if not isinstance(batch, dict) or {"mask", "segments", "ref"} - set(batch):
        keys = sorted(batch) if isinstance(batch, dict) else "token rows alone"
        raise ValueError(f"DPO takes pairs — a batch with 'tokens', 'mask', 'segments' (1: chosen, 2: rejected) and "
                         f"'ref' (the reference's log-probabilities [B, 2]) — not {keys}; load them with "
                         "data.source=pairs")


def next_token_loss(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, remat: str = "none",
                    par: Parallel = SINGLE_DEVICE, pipe: Pipeline | None = None, objective: bool = False,
                    mtp_weight: float = 0.0, density: jax.Array | None = None, dpo: DPO | None = None):
    """Mean cross-entropy (float32, nats/token) of predicting rows[:, 1:] from rows[:, :-1]. batch: token rows int
    [B, T+1], or with a loss mask (`Batch`) the mean over the masked-in targets: `masked_mean`, whose `density` is
    the whole step's (`target_density`; default: these rows', right when they are the whole step).

    With `pipe`, these are this stage's rows and the layers run through the circular pipeline (`pipeline_loss`).
    Under context parallelism each rank scores its part of every row's tokens (`sequence_share`).

    objective: return (what training minimises — the loss plus the MoE layers' weighted load-balancing and z-losses,
    jaxpar.model.moe_objective — , (the loss, the MoE statistics summed over these rows, per MoE layer [L_moe, …] —
    under a pipeline this stage's layers' rows, zeros in the others')) instead.

    With MTP (model.mtp_depth = n > 0, `objective`): the objective also adds mtp_weight/n · Σ_k (depth k's mean
    cross-entropy over its valid positions, `mtp_loss`), and the statistics gain "mtp": {"ce": [n] the summed
    cross-entropy of each depth over these rows' valid positions, "count": [n] how many} — sums, so the step's
    mtp_loss is exact at any layout.

    dpo: the loss is the preference loss of the pairs the rows hold (`head_loss`; the batch: `check_pairs`), and
    the statistics gain "dpo" (its sums: jaxpar.train.dpo.pair_loss)."""
    model = nnx.merge(graphdef, params)
    mtp = objective and model.cfg.mtp_depth > 0
    rows, mask, segments = rows_of(batch)
    if (mask is not None or segments is not None) and model.cfg.mtp_depth > 0:
        raise ValueError("a loss mask or packed documents with the MTP modules (model.mtp_depth > 0) are not "
                         "supported: their targets lie 2.. tokens ahead and would need the mask's own share per "
                         "depth; train with model.mtp_depth=0 (or --drop-mtp on import)")
    if dpo is not None:
        check_pairs(batch)
    density = target_density(batch) if density is None else density
    if pipe is not None:
        loss, stats, extra, sums = pipeline_loss(model, batch, pipe, remat, par, mtp=mtp, density=density, dpo=dpo)
    else:
        share = sequence_share(batch, par)
        # logits [B, T(/c), V_local], then the last hidden states [B, T(/c), D] (what the MTP modules read)
        logits, stats, h = model(share.tokens, positions=share.positions, segment_ids=share.segments, remat=remat,
                                 par=par.with_noise(model.cfg.lora.dropout, share.coords), stats=True, hidden=True)
        loss, sums = head_loss(logits, share, batch, density, par, dpo)
        extra = mtp_objective(model, h, rows, share.positions, remat, par) if mtp else None
    if not objective:
        return loss
    value = loss + moe_objective(stats, model.cfg, rows.shape[0])
    if mtp:
        value, stats = value + mtp_weight * extra[0], {**stats, "mtp": extra[1]}
    return value, (loss, {**stats, **sums})


def mtp_objective(model, h: jax.Array, rows: jax.Array, positions: jax.Array, remat: str, par: Parallel
                  ) -> tuple[jax.Array, dict]:
    """The MTP modules on the main model's last hidden states h [R, T(/t or /c), D] (before the final norm) of
    token rows rows int [R, T+1] at positions [R, T(/c)] → `mtp_loss`'s (1/n Σ_k mean cross-entropy of depth k,
    its sums). Wherever the rows' last hidden states are: the whole step's on one device, a stage's finished
    microbatches under a pipeline (beside the head)."""
    # the MTP modules' inputs, targets and valid positions, each [n, R, T(/c)]
    mtp_in, mtp_out, valid = (jnp.stack([par.context_shard(x) for x in a])
                              for a in mtp_targets(rows, model.cfg.mtp_depth))
    # mask None: causal (within the model's window), the kernels' own, as the main model's layers run here
    logits = model.mtp_logits(h, mtp_in, positions, None, remat=remat, par=par)  # [n, R, T(/c), V_local]
    return mtp_loss(logits, mtp_out, valid, rows.shape[1] - 1, par)


def mtp_loss(logits: jax.Array, targets: jax.Array, valid: jax.Array, T: int, par: Parallel = SINGLE_DEVICE
             ) -> tuple[jax.Array, dict]:
    """The MTP loss of these rows: logits [n, R, T_local, V_local] (`Transformer.mtp_logits`), targets and valid
    [n, R, T_local] (`mtp_targets`, this rank's share of each row under context parallelism); T the whole rows'
    length. → (1/n Σ_k mean cross-entropy of depth k, {"ce": [n] summed cross-entropy, "count": [n] valid
    positions}).

    The mean divides by the share of depth k's valid positions these rows' tokens would hold in proportion,
    R·T_local·(T−k)/T — exactly the count on one device and on each data shard; under context parallelism, where
    the last positions sit on some ranks only, the pmean of the shares is still the mean over the whole rows."""
    n, R, T_local = valid.shape
    ce = jnp.stack([par.cross_entropy(a, t) for a, t in zip(logits, targets)]) * valid  # [n, R, T_local]
    share = R * T_local * (T - np.arange(1, n + 1)) / T  # [n]: static
    per_depth = ce.sum((1, 2)) / jnp.asarray(share, jnp.float32)
    return per_depth.mean(), {"ce": ce.sum((1, 2)), "count": valid.sum((1, 2)).astype(jnp.float32)}


def sequence_share(batch: Batch, par: Parallel) -> Share:
    """This rank's `Share` of a batch of rows [B, T+1]: all of it, or its [B, T/c] part under context parallelism
    (targets, weights and positions are taken before the split, so the ones across a shard boundary are right)."""
    rows, _, segments = rows_of(batch)
    tokens, targets, weights = rows[:, :-1], rows[:, 1:], target_weights(batch)
    if segments is not None:
        segments = segments[:, :-1]
    positions = default_positions(*tokens.shape) if segments is None else segment_positions(segments)
    coords = batch["coords"][:, :-1] if isinstance(batch, dict) and "coords" in batch else None
    shard = lambda a: None if a is None else par.context_shard(a)  # noqa: E731
    return Share(shard(tokens), shard(targets), shard(positions), shard(weights), shard(segments), shard(coords))


def dropout_coords(step: jax.Array, rows: int, length: int, seed: int) -> jax.Array:
    """uint32 [rows, length]: each token's place in the run — (step·rows + row)·length + position, offset by the
    seed's mix — from which LoRA dropout draws its masks (jaxpar.matmul.LoRADropout). Distinct for every token of
    every step (mod 2³²), and cut with the rows and the sequence like the tokens, so a token's masks are the same
    whichever rank, microbatch or accumulation chunk runs it."""
    row = step.astype(jnp.uint32) * np.uint32(rows) + jnp.arange(rows, dtype=jnp.uint32)
    return row[:, None] * np.uint32(length) + jnp.arange(length, dtype=jnp.uint32) + mix32(jnp.uint32(seed))


def packed(share: Share) -> dict | None:
    """The side inputs a run of layers reads beside its input, [R, T(/c)] each, or None when there are none:
    packed rows' {"positions", "segments"} (unpacked rows share their positions and the kernels' causal mask), and
    with LoRA dropout the tokens' "coords"."""
    side = {} if share.segments is None else {"positions": share.positions, "segments": share.segments}
    if share.coords is not None:
        side["coords"] = share.coords
    return side or None


def microbatch_side(share: Share, microbatches: int, order=None) -> dict | None:
    """`packed` per microbatch for a pipeline, each leaf [m, mb, T(/c)], from a `Share` of the rows [m·mb, …]
    (microbatch j = rows j·mb …, or those of `order`[j])."""
    side = packed(share)
    if side is None:
        return None
    side = jax.tree.map(lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:]), side)
    return side if order is None else jax.tree.map(lambda a: a[np.asarray(order)], side)


def layer_inputs(cfg, par: Parallel, side: dict | None, positions: jax.Array):
    """(positions, masks, context) a run of layers takes: the packed microbatch's own (its `side`), else
    `positions` and the kernels' causal mask; and `par`, dropping the adapters' inputs of the side's tokens where
    it has their "coords" (LoRA dropout: `Parallel.with_noise`)."""
    side = side or {}
    par = par.with_noise(cfg.lora.dropout, side.get("coords"))
    if "segments" not in side:
        return positions, None, par
    T = side["segments"].shape[1]
    return side["positions"], layer_masks(cfg, functools.partial(par.attention_mask, T, side["segments"])), par


def in_model_order(stats: dict, pipe: Pipeline) -> dict:
    """This stage's MoE statistics per chunk (each leaf [v, k, …]: row r is the r-th of its chunks in chunk order, k
    its MoE layers) as rows of the model's [L_moe, …] stack, zeros at the other stages' layers — a sum over `pipe`
    then holds every layer's. Every chunk has the same dense / MoE pattern (the config checks it), so MoE layer j of
    chunk c is the model's MoE layer c·k + j."""
    if not stats:
        return stats
    p, v = pipe.stages, pipe.repeats
    placement = tables.placement(pipe.schedule, p, v)  # chunk → its stage
    rows = [sum(placement[d] == placement[c] for d in range(c)) for c in range(p * v)]  # chunk → its row there
    mine = jnp.asarray(placement) == jax.lax.axis_index(PIPE)  # [p·v]: the chunks this stage holds

    def place(a):  # [v, k, …] → [p·v·k, …]
        out = jnp.where(mine.reshape(-1, *[1] * (a.ndim - 1)), a[np.asarray(rows)], 0).astype(a.dtype)
        return out.reshape(-1, *a.shape[2:])

    return jax.tree.map(place, stats)


def pipeline_loss(model, batch: Batch, pipe: Pipeline, remat: str, par: Parallel, mtp: bool = False,
                  density: jax.Array | None = None, dpo: DPO | None = None
                  ) -> tuple[jax.Array, dict, tuple | None, dict]:
    """Embed this stage's rows (and run a dense prefix on them: `ModelConfig.prefix_layers`), run the other layers
    through the circular pipeline, then head and loss on the microbatches the stage holds at the end (paired with
    their token rows, which are all-gathered over `pipe`). → (loss, the MoE statistics of this stage's layers over
    all m microbatches (`in_model_order`) — m·mb = p·R rows, p times the stage's own R: the caller's objective
    divides by R, and the pipeline step's 1/p scale makes it p·R —, and with `mtp` the MTP modules' `mtp_objective`
    on the held microbatches, else None, and the sums `head_loss` reports for them (DPO's)).

    The prefix and the MTP modules run where embedding and head do, each stage on its own R rows — no stage idles
    while another runs them, and their parameters, which every stage holds whole, get the pipeline step's psum
    over `pipe` as the embedding's and the head's do."""
    p, v, m = pipe.stages, pipe.repeats, pipe.microbatches
    q = m // p
    cfg = model.cfg
    own = sequence_share(batch, par)  # [R, T(/c)] each, R = q·mb rows of this stage
    R, T = own.tokens.shape
    mb = R // q
    stacks = model.stacks()
    x = model.embed_tokens(own.tokens, own.positions, par)  # [R, T(/t), D]
    if cfg.prefix_layers:  # DeepSeek's dense first layers, beside the embedding (their stats: none, dense)
        positions, masks, prefix_par = layer_inputs(cfg, par, packed(own), own.positions)
        prefix = {"dense_blocks": stacks.pop("dense_blocks")}
        x = run_layers(prefix if prefix_par.noise is None else layer_seeds(prefix), x, positions, masks, cfg,
                       remat=remat, par=prefix_par)
    if own.coords is not None:  # LoRA dropout: each layer's seed, with the layer through the stage's passes
        stacks = layer_seeds(stacks, pipe.stack_order, PIPE)
    io = x.reshape(q, mb, *x.shape[1:])
    per_pass = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stacks)
    # every stage's rows [p, q, mb, T+1] (and mask, segments): the held microbatches' targets, and packed rows'
    # positions and documents for whichever microbatch a stage runs
    all_rows = jax.tree.map(lambda a: jax.lax.all_gather(a.reshape(q, mb, a.shape[1]), PIPE), batch)
    # microbatch label j is stage −⌊j/q⌋ mod p's slot j mod q (circular's module docstring): rows in label order
    label = [(-(j // q)) % p * q + j % q for j in range(m)]
    side = None if own.segments is None and own.coords is None else microbatch_side(
        sequence_share(jax.tree.map(lambda a: a.reshape(p * q * mb, -1), all_rows), par), p * q, order=label)

    def stage(layers, h, side=None):
        # unpacked: every row's positions alike
        positions, masks, stage_par = layer_inputs(cfg, par, side, own.positions[:mb])
        return run_layers(layers, h, positions, masks, cfg, remat=remat, par=stage_par, stats=True,
                          first_layer=cfg.prefix_layers)

    out, stats = circular.circular(stage, per_pass, io, stages=p, repeats=v, microbatches=m, stats=True, side=side,
                                   skip_bubble=pipe.skip_bubble)
    stats = in_model_order(stats, pipe)
    h = out.reshape(R, *out.shape[2:])  # [R, T(/t), D]: the held microbatches' last hidden states
    logits = model.logits(h, par)  # [R, T, V_local]
    held = jnp.asarray(circular.output_order(p, v, m))[jax.lax.axis_index(PIPE)]  # [q] starting slots s·q + c
    held_rows = jax.tree.map(lambda a: a[held // q, held % q].reshape(R, a.shape[-1]), all_rows)  # [R, T+1]
    share = sequence_share(held_rows, par)
    extra = mtp_objective(model, h, rows_of(held_rows)[0], own.positions, remat, par) if mtp else None
    loss, sums = head_loss(logits, share, held_rows, density, par, dpo)
    return loss, stats, extra, sums


def scheduled_loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, pipe: Pipeline,
                             remat: str, par: Parallel, mtp_weight: float = 0.0, density: jax.Array | None = None,
                             dpo: DPO | None = None) -> tuple[jax.Array, nnx.State, dict]:
    """This stage's share of (loss, gradients of what trains (`learnable`), its layers' MoE statistics over every
    row) under a schedule table
    (`executor.execute`): the table, not autodiff of a loop, decides when each microbatch's backward runs and what
    stays alive.

    Every stage gathers the step's token rows over `pipe` (4 bytes a token): microbatch j is rows j·mb … of them,
    embedded (and run through a dense prefix: `ModelConfig.prefix_layers`) by the stage that holds chunk 0 and
    scored — with the MTP modules, weight mtp_weight, when the model has them — by the one that holds the last
    chunk. The loss and the gradients of the parameters outside the chunks come back as shares to be summed over
    `pipe`, as the circular path's do; the MTP modules' sums join the statistics ("mtp")."""
    v, m = pipe.repeats, pipe.microbatches
    rows = jax.tree.map(lambda a: jax.lax.all_gather(a, PIPE, tiled=True), batch)  # [N, T+1]: every stage's rows
    share = sequence_share(rows, par)
    N, T = share.tokens.shape  # rows (T: this rank's share of the tokens under context parallelism)
    mb = N // m
    side = microbatch_side(share, m)  # packed rows: each microbatch's positions and documents
    positions = share.positions[:mb]  # (unpacked: every row's alike)
    cfg = nnx.merge(graphdef, params).cfg
    mtp = cfg.mtp_depth > 0
    # the stacks the chunks hold: those on the `layers` axis (a dense prefix joins the embedding, in `rest`)
    stack_names = tuple(name for name in cfg.layer_stacks if not (cfg.prefix_layers and name == "dense_blocks"))
    in_chunks = lambda path, _: path[0] in stack_names  # noqa: E731  (top-level: never mtp/blocks)
    blocks, everything_else = nnx.split_state(params, in_chunks, ...)  # the layers | the rest
    # What trains (differentiated) | what does not — the layers' buffers, and with LoRA every frozen weight:
    # constants of the executor, which computes no gradient for them. Of the rest (embedding, final norm, head),
    # the part that trains is the executor's `rest`; a frozen part rides in the closures.
    weights, fixed = learnable(blocks), frozen_of(blocks)
    rest, frozen_rest = learnable(everything_else), frozen_of(everything_else)
    # [v·k, …] in storage order → [v, k, …]: chunk r of this stage is row r (pipeline_order), in every stack
    per_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), tree)  # noqa: E731
    layers, constants = per_chunk(weights), per_chunk(fixed)
    if share.coords is not None:  # LoRA dropout: each layer's seed (`layer_seeds`), a constant of its chunk
        seeds = layer_seeds({stack: {k: v[...] for k, v in fixed[stack].items()} for stack in stack_names},
                            pipe.stack_order, PIPE)
        constants = (constants, per_chunk({stack: seeds[stack]["lora_seed"] for stack in stack_names}))
    # LoRA: every weight gradient is an adapter's (r·(in + out) a matrix) — B derives them with the input gradient
    # and W has nothing to defer, so the chunk runs without a tape (its base weights are constants)
    tape_on = not cfg.lora.rank

    def chunk_fn(chunk: nnx.State, x: jax.Array, tape, consts):
        # consts: the chunk's constants, or with packed rows (its constants, the microbatch's side: `execute`)
        consts, mside = consts if side is not None else (consts, None)
        consts, seeds = consts if share.coords is not None else (consts, None)

        def arrays(state, stack):  # a stack's parameters (Params) in `state`, by name
            return {name: var[...] for name, var in state[stack].items() if isinstance(var, nnx.Param)} \
                if stack in state else {}

        # the layers' weights (trained, and frozen ones), and the buffers their forward reads (the routing's
        # correction bias) as constants
        stacked = {stack: {**layer_operands({**arrays(chunk, stack), **arrays(consts, stack)}, cfg),
                           **forward_buffers(dict(consts[stack].items()) if stack in consts else {}, cfg),
                           **({} if seeds is None else {"lora_seed": seeds[stack]})}
                   for stack in stack_names}
        at, masks, chunk_par = layer_inputs(cfg, par, mside, positions)
        y, stats = run_layers(stacked, x, at, masks, cfg, remat=remat,
                              par=chunk_par.with_tape(tape if tape_on else None),
                              stats=True, first_layer=cfg.prefix_layers)
        # F of an MoE chunk (a tape's MEASURE and REPLAY report no statistics: `Tape.scan`): its layers' aux losses
        # over this microbatch join the objective like its loss
        if stats:
            y = executor.add_to_objective(y, moe_objective(stats, cfg, x.shape[0]), 1.0 / m)
        return y, stats  # the statistics are summed over the F ticks (logged, not differentiated)

    def embed_fn(r: nnx.State, inputs: dict) -> jax.Array:  # a microbatch's tokens (and side, packed)
        model = nnx.merge(graphdef, r, frozen_rest, blocks)
        at, masks, prefix_par = layer_inputs(cfg, par, inputs.get("side"), positions)
        x = model.embed_tokens(inputs["tokens"], at, par)
        if cfg.prefix_layers:
            prefix = {"dense_blocks": model.dense_blocks.stacked()}
            x = run_layers(prefix if prefix_par.noise is None else layer_seeds(prefix), x, at, masks, cfg,
                           remat=remat, par=prefix_par)
        return x

    def head_loss_fn(r: nnx.State, y: jax.Array, rows: Batch) -> tuple[jax.Array, dict]:
        model = nnx.merge(graphdef, r, frozen_rest, blocks)
        loss, sums = head_loss(model.logits(y, par), sequence_share(rows, par), rows, density, par, dpo)
        if not mtp:
            return loss, sums
        extra, mtp_sums = mtp_objective(model, y, rows_of(rows)[0], positions, remat, par)
        # the MTP loss joins the objective (weight λ, per microbatch 1/m as the loss) but not the loss reported
        return executor.add_to_objective(loss, extra, mtp_weight / m), {**sums, "mtp": mtp_sums}

    loss, layer_grads, rest_grads, stats, head_sums = executor.execute(
        pipe.program, chunk_fn, layers, rest,
        {"tokens": share.tokens.reshape(m, mb, T), **({} if side is None else {"side": side})},
        jax.tree.map(lambda a: a.reshape(m, mb, a.shape[1]), rows),
        embed_fn, head_loss_fn, axis=PIPE, operand=lambda w, role: par.policy(role).operand(w, cfg.dtype),
        constants=constants, side=side)
    block_grads = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), layer_grads)
    return loss, merge_state(rest_grads, block_grads), {**in_model_order(stats, pipe), **head_sums}


def loss_and_grads(graphdef: nnx.GraphDef, *, grad_accum: int = 1, remat: str = "none",
                   par: Parallel = SINGLE_DEVICE, grad_axes: tuple[str, ...] = (), pipe: Pipeline | None = None,
                   pipe_replicated=None, zero_dims=None, grad_dims=None, expert_split=None, stats: bool = False,
                   mtp_weight: float = 0.0, dpo: DPO | None = None) -> Callable[..., tuple[jax.Array, nnx.State]]:
    """(params, batch, density=None) → (mean loss, gradients), on whatever rows it is given (batch: token rows int
    [B, T+1], or with a loss mask, `Batch`; density: the whole step's `target_density`, default these rows'); with
    `stats`, also the MoE layers' statistics summed over every row, per MoE layer in model order (each leaf
    [L_moe, …]; jaxpar.model.moe; {} for a dense model).

    Gradient accumulation splits the rows into `grad_accum` equal chunks run one after another (a scan), so peak
    activation memory is that of B/grad_accum sequences. Chunk a takes rows a, a+A, a+2A, … (a strided split) so each
    data shard contributes B/(data·A) of its own rows to every chunk and no rows move between devices. Chunks are
    equal-sized, so the mean of chunk means is the full-batch mean.

    grad_axes: inside shard_map, the axes over which rows are split (but a running pipeline's `pipe`): loss and
    gradients are averaged over them once, after accumulation (an all-reduce of the gradients, as in any
    data-parallel step). One pmean over the tuple: a size-1 axis leaves the replica groups, and so the numbers,
    exactly as without it — but it must be named, or the loss would leave the shard_map typed as varying over it
    (check_vma rejects that).

    pipe: the circular pipeline's counts; rows are then split over `pipe` too. Each stage differentiates
    loss_s / p: autodiff through the pipeline's ppermutes already sums every stage's loss into the gradients of the
    layers a stage owns; parameters replicated over `pipe` (embedding, final norm, head; `pipe_replicated` marks
    them) were used by each stage on its own rows only, so their gradients are summed over `pipe`.

    zero_dims (ZeRO-3): per parameter, the dim split over `data` (-1: none). Those arrive as 1/data shards: they are
    all-gathered once before the step's first chunk, and their gradients reduce-scattered over `data` (instead of
    all-reduced) after the last, then averaged over the other gradient axes — the whole model is gathered for the
    step, not layer by layer.

    grad_dims (ZeRO-1, and ZeRO-3 where it equals zero_dims): per parameter, the dim along which its *gradient* leaves
    split over `data` (-1: replicated) — the split of the optimizer state, so that the update runs on 1/data of
    every gradient and a reduce-scatter (half an all-reduce's bytes) replaces the all-reduce. Default: zero_dims.

    expert_split: per parameter, whether it is split over `expert` (the experts of MoE layers): its gradient holds
    every expert rank's tokens' contributions already (the all-to-all's transpose brought them), so it is divided
    by the expert degree and averaged over the other gradient axes only.

    mtp_weight: λ of the MTP loss (model.mtp_depth > 0: `next_token_loss`); the statistics then hold "mtp".

    dpo: the preference loss of pairs instead of the next-token loss (`next_token_loss`); the statistics then hold
    "dpo". A pair is one row, so every way of cutting rows above keeps pairs whole, and its equal-sized pieces'
    means of per-pair losses average to the step's, as the cross-entropy's do.
    """
    scale = 1.0 / pipe.stages if pipe is not None else 1.0

    def objective(learn, rest, b, density):  # (what is differentiated: the loss plus the MoE terms, (the loss,
        # MoE sums)) as a function of the parameters that train; the rest — frozen parameters, buffers — constants
        p = merge_state(learn, jax.tree.map(jax.lax.stop_gradient, rest))
        value, (loss, sums) = next_token_loss(graphdef, p, b, remat, par, pipe, objective=True, mtp_weight=mtp_weight,
                                              density=density, dpo=dpo)
        return scale * value, (scale * loss, sums)

    differentiate = jax.value_and_grad(objective, has_aux=True)

    def grad_fn(p, b, density):  # → (loss, the gradients of `learnable(p)`, sums)
        (_, (loss, sums)), grads = differentiate(learnable(p), frozen_of(p), b, density)
        return loss, grads, sums

    if pipe is not None and pipe.schedule != "circular":
        def grad_fn(p, b, density):
            loss, grads, sums = scheduled_loss_and_grads(graphdef, p, b, pipe=pipe, remat=remat, par=par,
                                                         mtp_weight=mtp_weight, density=density, dpo=dpo)
            return loss, learnable(grads), sums

    # the trees that describe each gradient (the parameters that train)
    pipe_replicated, grad_dims, expert_split = (None if t is None else learnable(t)
                                                for t in (pipe_replicated, grad_dims, expert_split))
    zero_grad_dims = None if zero_dims is None else learnable(zero_dims)

    batch_axes = tuple(grad_axes) + ((PIPE,) if pipe is not None else ())

    def run(params: nnx.State, batch: Batch, density: jax.Array | None = None) -> tuple[jax.Array, nnx.State]:
        density = target_density(batch) if density is None else density
        params = gather_zero(params, zero_dims)
        if batch_axes:
            # Under check_vma a parameter replicated over the batch axes would be broadcast implicitly where it meets
            # this shard's rows, and autodiff would psum its gradient there. Typing it as varying first keeps the
            # gradients local, so the reductions below are the only ones: one pmean over the gradient axes, one psum
            # over pipe.
            params = jax.tree.map(lambda x: vary(x, batch_axes), params)
        if grad_accum == 1:
            loss, grads, sums = grad_fn(params, batch, density)
        else:
            A, B = grad_accum, rows_of(batch)[0].shape[0]
            chunks = jax.tree.map(lambda a: constrain(a.reshape(B // A, A, *a.shape[1:]).swapaxes(0, 1),
                                                      (None, "batch", None)), batch)  # [A, B/A, T+1] ("ref": 2)

            def accumulate(carry, chunk):
                loss_sum, grad_sum = carry
                loss, grads, sums = grad_fn(params, chunk, density)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), sums

            zeros = jax.tree.map(jnp.zeros_like, learnable(params))
            # the loss carry starts typed like the per-chunk losses it sums (varying over the batch axes: check_vma)
            loss_zero = vary(jnp.zeros((), jnp.float32), batch_axes)
            (loss_sum, grad_sum), sums = jax.lax.scan(accumulate, (loss_zero, zeros), chunks)
            loss, grads = loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum)
            sums = jax.tree.map(lambda a: a.sum(0), sums)
        if pipe is not None:
            loss = jax.lax.psum(loss, PIPE)
            grads = jax.tree.map(lambda g, rep: jax.lax.psum(g, PIPE) if rep else g, grads, pipe_replicated)
            sums = jax.tree.map(lambda a: jax.lax.psum(a, PIPE), sums)  # each stage counted its own layers
        if grad_axes:
            loss = jax.lax.pmean(loss, grad_axes)
            dims = next((d for d in (grad_dims, zero_grad_dims) if d is not None), None)
            dims = dims if dims is not None else jax.tree.map(lambda _: -1, grads)
            split = expert_split if expert_split is not None else jax.tree.map(lambda _: False, grads)
            grads = jax.tree.map(lambda g, d, e: _mean(g, d, grad_axes, e), grads, dims, split)
            # each rank's sums are over its own rows, whatever they vary over by type (the MTP modules' count of
            # valid positions depends on the positions alone: under context parallelism it varies over `context`
            # only, and a psum wants one typing over all its axes)
            sums = jax.tree.map(lambda a: jax.lax.psum(vary(a, grad_axes), grad_axes), sums)
        return (loss, grads, sums) if stats else (loss, grads)

    return run


def _mean(g: jax.Array, dim: int, grad_axes: tuple[str, ...], expert_split: bool) -> jax.Array:
    """The mean over `grad_axes` of one gradient. dim ≥ 0 (ZeRO): it is stored split over `data` along `dim`, so
    reduce-scatter over data (each rank keeps the 1/data slice it stores), then the mean over the other gradient
    axes. expert_split: the parameter is split over `expert` and its gradient already sums every expert rank's
    rows, so divide by the expert degree instead of averaging over `expert`."""
    if expert_split:
        g = g / jax.lax.axis_size(EXPERT)
        grad_axes = tuple(a for a in grad_axes if a != EXPERT)
    if dim >= 0:
        g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True) / jax.lax.axis_size(DATA)
        grad_axes = tuple(a for a in grad_axes if a != DATA)
    return jax.lax.pmean(g, grad_axes) if grad_axes else g


def gather_zero(params: nnx.State, zero_dims) -> nnx.State:
    """ZeRO-3: all-gather over `data` every parameter stored split along dim zero_dims[...] (≥ 0)."""
    if zero_dims is None:
        return params
    return jax.tree.map(lambda p, d: p if d < 0 else jax.lax.all_gather(p, DATA, axis=d, tiled=True), params,
                        zero_dims)


def _zero_dims(param_specs: nnx.State):
    return jax.tree.map(lambda spec: list(spec).index(DATA) if DATA in list(spec) else -1, param_specs)


def sharded_loss_and_grads(graphdef: nnx.GraphDef, plan: Plan, *, grad_accum: int = 1, remat: str = "none",
                           param_specs: nnx.State | None = None, grad_specs: nnx.State | None = None,
                           stats: bool = False, mtp_weight: float = 0.0, dpo: DPO | None = None):
    """`loss_and_grads` over the global batch: under shard_map on the plan's mesh when the plan is sharded (params
    laid out by `param_specs`, rows over the batch axes), else as one global computation (single device, or GSPMD
    on a mesh). grad_specs: how the gradients leave (default param_specs); ZeRO-1 passes the optimizer state's
    specs, split over `data`, so the gradients are reduce-scattered rather than all-reduced."""
    if not plan.sharded:
        if plan.pipeline is not None:  # make_plan refuses this combination; never drop a pipeline silently
            raise ValueError("a pipeline needs the explicit shard_map step (an explicit plan)")
        return loss_and_grads(graphdef, grad_accum=grad_accum, remat=remat, stats=stats, mtp_weight=mtp_weight,
                              dpo=dpo, par=whole(plan))
    replicated = jax.tree.map(lambda spec: PIPE not in _mesh_axes(spec), param_specs)
    expert_split = jax.tree.map(lambda spec: EXPERT in _mesh_axes(spec), param_specs)
    local = loss_and_grads(graphdef, grad_accum=grad_accum, remat=remat, par=plan.parallel, grad_axes=plan.grad_axes,
                           pipe=plan.pipeline, pipe_replicated=replicated, zero_dims=_zero_dims(param_specs),
                           grad_dims=None if grad_specs is None else _zero_dims(grad_specs),
                           expert_split=expert_split, stats=stats, mtp_weight=mtp_weight, dpo=dpo)
    grad_specs = learnable(param_specs if grad_specs is None else grad_specs)  # the parameters that train
    out_specs = (P(), grad_specs, P()) if stats else (P(), grad_specs)
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(param_specs, plan.batch_spec, P()), out_specs=out_specs,
                           check_vma=True)
    # the step's density of targets, over the global batch (outside the shard_map: the compiler sums over devices)
    return lambda params, batch: mapped(params, batch, target_density(batch))


def whole(plan: Plan) -> Parallel:
    """The context of a step that runs as one global computation (one device, or GSPMD on a mesh): no explicit
    collectives, the plan's matmul policies (`model.matmul`)."""
    return dataclasses.replace(SINGLE_DEVICE, matmul=plan.matmul)


def _mesh_axes(spec: P) -> set[str]:
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf, in float32 (what clip_by_global_norm compares against)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(grads_of: Callable[[nnx.State, jax.Array], tuple[jax.Array, nnx.State]],
                    tx: optax.GradientTransformation, schedule: optax.Schedule | None = None, moe_layers: int = 0,
                    update_buffers: Callable[[nnx.State, dict], nnx.State] | None = None,
                    dropout_seed: int | None = None
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, Metrics]]:
    """(state, batch) → (state, metrics {loss, grad_norm, skipped, lr}; with a loss mask also `targets`, the
    number of targets scored): batch token rows int [B, T+1] or `Batch` with a mask; gradients from `grads_of`
    (`sharded_loss_and_grads`), then clipping and AdamW on the sharded weights. When `grads_of` also returns MoE
    statistics (stats=True), the metrics gain `moe_metrics` over the model's `moe_layers` MoE layers, and the
    model's buffers (jaxpar.model.Buffer) become `update_buffers(buffers, the per-layer statistics [L_moe, …])` —
    the optimizer sees the weights alone (their gradients; the buffers' are dropped: they are constants of the
    loss). Statistics holding "mtp" (an MTP model) add `mtp_loss`: the mean over depths of each depth's mean
    cross-entropy over every valid position of the step (`mtp_loss`). dropout_seed: LoRA dropout is on (the model's
    `lora.dropout` > 0): the batch gains its tokens' "coords" (`dropout_coords`) from the step and this seed."""

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        if dropout_seed is not None:
            rows = rows_of(batch)[0]
            coords = dropout_coords(state.step, *rows.shape, dropout_seed)
            batch = {**(batch if isinstance(batch, dict) else {"tokens": batch}), "coords": coords}
        loss, grads, *sums = grads_of(state.params, batch)
        mtp = sums[0].pop("mtp", None) if sums and sums[0] else None
        pairs = sums[0].pop("dpo", None) if sums and sums[0] else None
        # the optimizer sees what trains (every weight, or LoRA's adapters); frozen weights and buffers pass by
        grads, weights, buffers = learnable(grads), learnable(state.params), buffers_of(state.params)
        frozen = trainable(frozen_of(state.params))
        updates, opt_state = tx.update(grads, state.opt_state, weights)
        weights = optax.apply_updates(weights, updates)
        if update_buffers is not None and sums and sums[0]:
            buffers = update_buffers(buffers, sums[0])
        params = merge_state(weights, frozen, buffers)
        grad_norm = global_norm(grads)
        # A non-finite loss, gradient or updated parameter skips the step: the state stays as it was, so no
        # NaN/Inf ever reaches the parameters (or a checkpoint). The loop counts and limits consecutive skips.
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(global_norm(params))
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), (params, opt_state),
                                         (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": 1 - ok.astype(jnp.int32)}
        rows, mask, segments = rows_of(batch)
        if mask is not None or segments is not None:
            metrics["targets"] = target_weights(batch).sum().astype(jnp.int32)
        if segments is not None:  # real tokens over the slots of the rows (padding is segment 0)
            metrics["packing"] = (segments > 0).astype(jnp.float32).mean()
        if sums and sums[0]:
            metrics.update(moe_metrics(stats_total(sums[0]), rows.shape[0], moe_layers, sums[0]["load"]))
        if pairs is not None:
            metrics.update(preference.metrics(pairs, rows.shape[0]))
        if mtp is not None:
            metrics["mtp_loss"] = (mtp["ce"] / jnp.maximum(mtp["count"], 1.0)).mean()
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def moe_metrics(sums: dict[str, jax.Array], rows: int, layers: int, layer_load: jax.Array | None = None) -> Metrics:
    """The step's MoE statistics (summed over its `rows` rows and its `layers` MoE layers) as metrics: per-expert
    load (assignments, all layers), its imbalance max/mean (1 is balanced), the share of assignments dropped, and the
    load-balancing and z-losses as means over rows and layers (the aux loss is 1 when balanced). With the loads per
    layer (`layer_load` [L_moe, X]), `moe_max_over_mean_load`: the worst layer's max/mean expert load (the layers'
    imbalances do not cancel in it, as they can in the sum over layers)."""
    load = sums["load"].astype(jnp.float32)
    out = {"moe_load": load, "moe_imbalance": load.max() / load.mean(), "moe_dropped": sums["dropped"] / load.sum(),
           "moe_aux_loss": sums["aux"] / (rows * layers), "moe_z_loss": sums["z"] / (rows * layers)}
    if layer_load is not None:
        per_layer = layer_load.astype(jnp.float32)
        out["moe_max_over_mean_load"] = (per_layer.max(-1) / per_layer.mean(-1)).max()
    return out


def make_eval_step(graphdef: nnx.GraphDef, plan: Plan, *, param_specs: nnx.State | None = None,
                   dpo: DPO | None = None) -> Callable[[nnx.State, Batch], jax.Array]:
    """(params, batch) → mean next-token loss (over the masked-in targets with a loss mask; with `dpo`, the
    preference loss of the batch's pairs)."""
    if not plan.sharded:
        return lambda params, batch: next_token_loss(graphdef, params, batch, par=whole(plan), dpo=dpo)

    zero_dims = _zero_dims(param_specs)

    def local(params, batch, density):
        loss = next_token_loss(graphdef, gather_zero(params, zero_dims), batch, par=plan.parallel, pipe=plan.pipeline,
                               density=density, dpo=dpo)
        if plan.pipeline is not None:
            loss = jax.lax.pmean(loss, PIPE)
        return jax.lax.pmean(loss, plan.grad_axes)

    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(param_specs, plan.batch_spec, P()), out_specs=P(),
                           check_vma=True)
    return lambda params, batch: mapped(params, batch, target_density(batch))


def make_reference_step(graphdef: nnx.GraphDef, plan: Plan, *, param_specs: nnx.State | None = None
                        ) -> Callable[[nnx.State, Batch], jax.Array]:
    """(params, pairs: a DPO batch without "ref") → float32 [B, 2]: each row's summed log-probabilities of its two
    answers (jaxpar.train.dpo.completion_logps) under `params` — the reference model's, which the step's batches
    carry as "ref". A forward pass alone, laid out like the batch's rows (over the batch axes), on a plan without a
    pipeline (`Plan.without_pipeline`: a pipeline holds each row's result on whichever stage finished it)."""
    if plan.pipeline is not None:
        raise ValueError("the reference pass runs without a pipeline: make it on plan.without_pipeline()")

    def logps(params, batch, par):
        share = sequence_share(batch, par)
        logits = nnx.merge(graphdef, params)(share.tokens, positions=share.positions, segment_ids=share.segments,
                                             par=par)
        ce = par.cross_entropy(logits, share.targets)
        return preference.completion_logps(ce, share.weights, share.segments, par, differentiable=False)[0]

    if not plan.sharded:
        return lambda params, batch: logps(params, batch, whole(plan))
    zero_dims = _zero_dims(param_specs)
    local = lambda params, batch: logps(gather_zero(params, zero_dims), batch, plan.parallel)  # noqa: E731
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(param_specs, plan.batch_spec), out_specs=plan.batch_spec,
                         check_vma=True)


def compile_steps(train_step, eval_step, mesh: Mesh | None, shardings):
    """jit both steps. With a mesh: explicit state/batch shardings and the mesh set while tracing (so the model's
    logical `constrain` calls resolve); the state buffer is donated so params and optimizer state update in place."""
    if mesh is None:
        return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)
    data = batch_sharding(mesh)
    train = jax.jit(train_step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(shardings.params, data))

    def with_mesh(fn):
        def call(*args):
            with jax.set_mesh(mesh):
                return fn(*args)

        def lower(*args):
            with jax.set_mesh(mesh):
                return fn.lower(*args)

        call.lower = lower
        return call

    return with_mesh(train), with_mesh(evaluate)
